"""Per-tier counters computed from the event stream (the only source of truth for reports)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .plans import Ev

__all__ = ["TierCounters", "HierarchyStats", "InPlaceHits", "read_in_place"]


@dataclass
class TierCounters:
    """Counters of one tier; all non-negative.

    ``hits``: accesses served from this tier. ``inserts``: new blocks placed here.
    ``evictions``: blocks that left the hierarchy from here (victims of the last tier, refused
    by the tier below, or with no tier below able to take them). ``demotions`` /
    ``promotions``: blocks this tier sent down / up. ``copies``: write-through copies sent
    from here. ``refused``: placements this tier's admission refused. ``promote_skipped``:
    hits and prefetched blocks of this tier that were to move up but stayed, no room could be
    made above (a streaming read, or a placement that keeps a hit where it lies, tries no
    promotion and counts none). ``lost``: stored copies found unreadable and dropped.
    """

    name: str
    capacity_blocks: int
    hits: int = 0
    inserts: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    copies: int = 0
    refused: int = 0
    failed_transfers: int = 0
    promote_skipped: int = 0
    lost: int = 0

    def as_dict(self) -> dict:
        """Plain dict for JSON."""
        return dict(self.__dict__)


@dataclass
class HierarchyStats:
    """Totals over a hierarchy, fed by ``consume(events)``.

    ``accesses == hits + misses``; ``hits`` is the sum of tier hits; recomputed blocks (prefix
    semantics) are misses.
    """

    tiers: list[TierCounters]
    misses: int = 0
    recomputed: int = 0
    _moves: dict = field(default_factory=dict)

    @classmethod
    def for_tiers(cls, names_and_capacities: Iterable[tuple[str, int]]) -> "HierarchyStats":
        """Empty counters for tiers given fastest first."""
        return cls([TierCounters(name, cap) for name, cap in names_and_capacities])

    @property
    def hits(self) -> int:
        """Accesses served by any tier."""
        return sum(t.hits for t in self.tiers)

    @property
    def accesses(self) -> int:
        """Hits plus misses."""
        return self.hits + self.misses

    def blocks_moved(self) -> dict[tuple[int, int], int]:
        """Blocks moved per (source tier, destination tier) link."""
        return dict(self._moves)

    def consume(self, events: Iterable[tuple[int, int, int, int]]) -> None:
        """Adds drained events to the counters."""
        tiers, moves = self.tiers, self._moves
        for kind, tier, count, aux in events:
            if kind == Ev.HIT:
                tiers[tier].hits += count
            elif kind == Ev.MISS:
                self.misses += count
            elif kind == Ev.RECOMPUTE:
                self.recomputed += count
            else:
                self._count_placement(kind, tiers[tier], count)
                if kind in (Ev.DEMOTE, Ev.PROMOTE, Ev.COPY):
                    moves[(tier, aux)] = moves.get((tier, aux), 0) + count

    @staticmethod
    def _count_placement(kind: int, counters: TierCounters, count: int) -> None:
        attr = _PLACEMENT_FIELDS.get(kind)
        if attr is not None:
            setattr(counters, attr, getattr(counters, attr) + count)


#: Events that say a run of hits stays where it lies: read in place by choice (a streaming read,
#: the placement's answer; no promotion tried) or because no room could be made above.
_STAYED = (Ev.READ_IN_PLACE, Ev.PROMOTE_SKIPPED)


def read_in_place(previous_kind: int, previous_source: int, tier: int) -> bool:
    """Whether a ``HIT`` in ``tier`` was read where it lies, given the event right before it
    (its kind and source tier): a top-tier hit, or a run of its own tier read in place
    (``READ_IN_PLACE``) or whose promotion found no room (``PROMOTE_SKIPPED``):
    ``TierManager._found_below`` emits a run's ``HIT`` right after that event."""
    return tier == 0 or (previous_kind in _STAYED and previous_source == tier)


@dataclass
class InPlaceHits:
    """Hits read where they lie, per tier, counted from the event stream.

    A hit is read in place when it is in the top tier, or when its run was not promoted:
    the manager emits a run's ``HIT`` right after the event that says how it was served
    (``TierManager._found_below``), so a lower-tier ``HIT`` that follows a ``READ_IN_PLACE``
    or a ``PROMOTE_SKIPPED`` of its own tier was read where it lies (``read_in_place``). This
    is the rule ``tiercache.sim.hitcost.HitMeter`` charges a replay's hits by.

    Invariants: ``counts[t]`` never exceeds tier ``t``'s hits counted from the same events;
    the top tier's hits are all in place.
    """

    counts: list[int]

    @classmethod
    def for_tiers(cls, n_tiers: int) -> "InPlaceHits":
        """No hits yet in any of ``n_tiers`` tiers."""
        return cls([0] * n_tiers)

    def consume(self, events: Iterable[tuple[int, int, int, int]]) -> None:
        """Adds the in-place hits of one drained batch (the order within a batch matters)."""
        previous_kind, previous_tier = -1, -1
        for kind, tier, count, _ in events:
            if kind == Ev.HIT and read_in_place(previous_kind, previous_tier, tier):
                self.counts[tier] += count
            previous_kind, previous_tier = kind, tier


_PLACEMENT_FIELDS = {
    Ev.INSERT: "inserts",
    Ev.EVICT: "evictions",
    Ev.DEMOTE: "demotions",
    Ev.PROMOTE: "promotions",
    Ev.COPY: "copies",
    Ev.REFUSED: "refused",
    Ev.TRANSFER_FAILED: "failed_transfers",
    Ev.PROMOTE_SKIPPED: "promote_skipped",
    Ev.LOST: "lost",
}
