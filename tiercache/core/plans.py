"""Plans handed from the metadata plane down to a transfer engine, and the event stream.

A ``TransferPlan`` is the only thing a transfer engine sees: source tier and slots,
destination tier and slots, and a job id. Engines never touch metadata; the manager applies
their completions (``JobResult``) on its own thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

__all__ = ["TransferPlan", "JobResult", "Room", "Ev", "EventLog"]


@dataclass(frozen=True)
class TransferPlan:
    """Copy ``ids`` from ``src`` slots of tier ``src_tier`` to ``dst`` slots of ``dst_tier``.

    Invariants: ``len(ids) == len(src_slots) == len(dst_slots)``; source slots are pinned and
    destination slots reserved from ``prepare`` until ``complete`` or ``abort``. ``keep_source``
    is True for copies (write-through) and False for moves (exclusive hierarchy).
    """

    job_id: int
    ids: tuple[int, ...]
    src_tier: int
    src_slots: np.ndarray = field(repr=False)
    dst_tier: int
    dst_slots: np.ndarray = field(repr=False)
    keep_source: bool = False

    @property
    def n_blocks(self) -> int:
        """Blocks this plan copies."""
        return len(self.ids)


@dataclass(frozen=True)
class JobResult:
    """Outcome of one submitted plan; ``error`` is None on success.

    ``lost`` names source blocks found unreadable (a corrupt or missing NVMe chunk), or
    holding values the destination's codec cannot store (inf, NaN: ``data.quantized``): the
    manager drops them instead of leaving them resident, so they are never served (nor
    moved again and again, holding their slots).
    ``present`` counts blocks the destination already held (a shared tier another process
    wrote them to): nothing was copied for them.
    """

    job_id: int
    error: str | None = None
    lost: tuple[int, ...] = ()
    present: int = 0

    @property
    def ok(self) -> bool:
        """True when the copy finished and the destination bytes are valid."""
        return self.error is None


class Room(enum.Enum):
    """Outcome of making room in a tier."""

    MADE = "made"  # the slots are free now
    NO_VICTIMS = "no victims"  # everything is pinned, referenced or protected: nothing changed
    WRITE_FAILED = "write failed"  # a write-back failed (full disk): every victim stayed


class Ev(enum.IntEnum):
    """Kinds of events in the stream; each event is ``(kind, tier, count, aux)``.

    ``aux`` is the other tier for moves (destination for DEMOTE/PROMOTE/COPY), else 0.
    """

    HIT = 0
    MISS = 1
    INSERT = 2
    EVICT = 3  # left the hierarchy by a policy decision (victim of the last tier)
    DEMOTE = 4  # moved to a lower tier as a victim
    PROMOTE = 5  # moved to a higher tier on a hit
    COPY = 6  # write-through copy to a lower tier
    REFUSED = 7  # admission refused a placement; the block was not stored there
    TRANSFER_FAILED = 8  # a job failed; its blocks stayed where they were
    RECOMPUTE = 9  # prefix semantics: a resident block after the first miss was recomputed
    PROMOTE_SKIPPED = 10  # a hit, or a prefetched block, stayed in its tier: no room could be made above
    LOST = 11  # a stored copy was unreadable (checksum or I/O) and was dropped
    READ_IN_PLACE = 12  # hits read where they lie by choice (a streaming read, or the placement's answer): no promotion tried


class EventLog:
    """Append-only event buffer that callers drain; injected, never a global singleton.

    With ``record_departures`` the log also collects the ids of blocks that left the
    hierarchy (dropped from their last tier, or lost); a composition root that keeps
    per-block state beside the manager (the live store's key map) drains them instead of
    being called back from inside the manager. Off by default: a replay never reads them.
    """

    __slots__ = ("_events", "_departed", "records_departures")

    def __init__(self, record_departures: bool = False) -> None:
        self._events: list[tuple[int, int, int, int]] = []
        self._departed: list[int] = []
        #: True when departed ids are collected (a plain attribute: read on every eviction).
        self.records_departures = record_departures

    def emit(self, kind: Ev, tier: int, count: int, aux: int = 0) -> None:
        """Records ``count`` occurrences of ``kind`` in ``tier`` (no-op for count 0)."""
        if count:
            self._events.append((kind, tier, count, aux))

    def departed(self, ids: list[int]) -> None:
        """Records ids that no tier holds any more (ignored unless recording)."""
        if self.records_departures:
            self._departed.extend(ids)

    def drain(self) -> list[tuple[int, int, int, int]]:
        """Returns and forgets the events recorded since the last drain."""
        events, self._events = self._events, []
        return events

    def drain_departed(self) -> list[int]:
        """Returns and forgets the departed ids recorded since the last drain, in order.

        An id may since have come back (stored again): check residency before acting.
        """
        departed, self._departed = self._departed, []
        return departed
