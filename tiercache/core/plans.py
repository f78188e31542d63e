"""Plans handed from the metadata plane down to a transfer engine, and the event stream.

A ``TransferPlan`` is the only thing a transfer engine sees: source tier and slots,
destination tier and slots, and a job id. Engines never touch metadata; the manager applies
their completions (``JobResult``) on its own thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

__all__ = ["TransferPlan", "JobResult", "Ev", "EventLog"]


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

    ``lost`` names source blocks found unreadable (a corrupt or missing NVMe chunk): the
    manager drops them instead of leaving them resident, so they are never served.
    """

    job_id: int
    error: str | None = None
    lost: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        """True when the copy finished and the destination bytes are valid."""
        return self.error is None


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
    PROMOTE_SKIPPED = 10  # a hit stayed in its tier because no room could be made above
    LOST = 11  # a stored copy was unreadable (checksum or I/O) and was dropped


class EventLog:
    """Append-only event buffer that callers drain; injected, never a global singleton."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: list[tuple[int, int, int, int]] = []

    def emit(self, kind: Ev, tier: int, count: int, aux: int = 0) -> None:
        """Records ``count`` occurrences of ``kind`` in ``tier`` (no-op for count 0)."""
        if count:
            self._events.append((kind, tier, count, aux))

    def drain(self) -> list[tuple[int, int, int, int]]:
        """Returns and forgets the events recorded since the last drain."""
        events, self._events = self._events, []
        return events
