"""What each lower-tier hit of a replay cost: read in place, or promoted, and never free.

A hit found below the top tier is served one of two ways (``TierManager._found_below``): the
run of blocks is promoted to the top tier (a ``PROMOTE`` event), or, when no room can be
made there (the run is larger than the top tier, or everything is pinned), it stays and is
read where it is (a ``PROMOTE_SKIPPED`` event). Either way its ``HIT`` event follows at
once, so the event before each lower-tier ``HIT`` tells which way it went. A read in place
still crosses the link to the top tier (attention runs there): ``HitMeter`` charges it on
that link of the ``SimEngine`` (bytes, a transfer, modeled seconds), exactly as a promotion
of the same blocks is charged, so a hierarchy that cannot promote never looks cheaper.

``HitMeter.consume`` reads the drained event batches the replay already hands to
``HierarchyStats``: Python work per event (one per run of blocks), none per access.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from tiercache.core.plans import Ev

from .engine import SimEngine

__all__ = ["HitCost", "HitMeter"]


@dataclass
class HitCost:
    """One tier's hits split by how they were served, with the bytes and modeled seconds each took.

    Invariants: ``in_place + promoted`` equals the tier's hits once the replay ends; the top
    tier's hits are all in place at no cost.
    """

    in_place: int = 0
    promoted: int = 0
    in_place_bytes: int = 0
    promoted_bytes: int = 0
    in_place_seconds: float = 0.0
    promoted_seconds: float = 0.0


class HitMeter:
    """Classifies and charges lower-tier hits from the event stream (see the module docstring).

    Args:
        engine: the run's engine; reads in place are charged on its links.
        n_tiers: tiers of the hierarchy, fastest first.
    """

    def __init__(self, engine: SimEngine, n_tiers: int) -> None:
        self.engine = engine
        self.costs = [HitCost() for _ in range(n_tiers)]

    def consume(self, events: Iterable[tuple[int, int, int, int]]) -> None:
        """Classifies every ``HIT`` in one drained batch by the event right before it.

        Raises:
            AssertionError: a lower-tier hit that was neither promoted nor read in place (a
                free hit: the manager's event order changed).
        """
        previous = (-1, -1, 0, 0)
        for event in events:
            if event[0] == Ev.HIT:
                self._hit(previous, event[1], event[2])
            previous = event

    def _hit(self, previous: tuple[int, int, int, int], tier: int, count: int) -> None:
        cost = self.costs[tier]
        if tier == 0:
            cost.in_place += count
            return
        kind, source, _, destination = previous
        if kind == Ev.PROMOTE_SKIPPED and source == tier:
            nbytes, seconds = self.engine.read_through(tier, count)
            cost.in_place += count
            cost.in_place_bytes += nbytes
            cost.in_place_seconds += seconds
        elif kind == Ev.PROMOTE and source == tier and destination == 0:
            nbytes, seconds = self.engine.cost(tier, 0, count)
            cost.promoted += count
            cost.promoted_bytes += nbytes
            cost.promoted_seconds += seconds
        else:
            raise AssertionError(f"{count} hit(s) in tier {tier} were neither promoted nor read in place")
