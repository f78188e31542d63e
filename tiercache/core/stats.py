"""Per-tier counters computed from the event stream (the only source of truth for reports)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .plans import Ev

__all__ = ["TierCounters", "HierarchyStats"]


@dataclass
class TierCounters:
    """Counters of one tier; all non-negative.

    ``hits``: accesses served from this tier. ``inserts``: new blocks placed here.
    ``evictions``: blocks that left the hierarchy from here (victims of the last tier, or
    refused by the tier below). ``demotions`` / ``promotions``: blocks this tier sent down /
    up. ``copies``: write-through copies sent from here. ``refused``: placements this tier's
    admission refused. ``lost``: stored copies found unreadable and dropped.
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
