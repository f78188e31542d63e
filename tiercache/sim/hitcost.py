"""What each hit of a replay cost: read in place, or promoted, and free only in HBM.

A hit found below the top tier is served one of two ways (``TierManager._found_below``): the
run of blocks is promoted to the top tier (a ``PROMOTE`` event), or, when no room can be
made there (the run is larger than the top tier, or everything is pinned), it stays and is
read where it is (a ``PROMOTE_SKIPPED`` event; ``READ_IN_PLACE`` when it was read where it lies
by choice, a streaming read: ``stats.read_in_place`` names both). Either way its ``HIT`` event follows at
once, so the event before each lower-tier ``HIT`` tells which way it went. A read in place
still crosses the link to HBM (attention runs there): ``HitMeter`` charges it on
that link of the ``SimEngine`` (bytes, a transfer, modeled seconds), exactly as a promotion
of the same blocks is charged, so a hierarchy that cannot promote never looks cheaper.

Attention runs on the GPU: a block is used only once it is in HBM. A hierarchy whose top tier
is HBM serves its top-tier hits free. One without HBM (``--tiers dram=...,nvme=...``) pays for
every hit: a top-tier hit is read in place on its link to HBM (``SimEngine``'s ``GPU``), and
a promoted hit, once moved up to the top tier, is read from there to HBM as well.

``HitMeter.consume`` reads the drained event batches the replay already hands to
``HierarchyStats``: Python work per event (one per run of blocks), none per access.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from tiercache.core.plans import Ev
from tiercache.core.stats import read_in_place

from .engine import GPU, SimEngine

__all__ = ["HitCost", "HitMeter", "in_place_cost", "promoted_cost"]


@dataclass
class HitCost:
    """One tier's hits split by how they were served, with the bytes and modeled seconds each took.

    Invariants: ``in_place + promoted`` equals the tier's hits once the replay ends; the top
    tier's hits are all in place, at no cost only when the top tier is HBM.
    """

    in_place: int = 0
    promoted: int = 0
    in_place_bytes: int = 0
    promoted_bytes: int = 0
    in_place_seconds: float = 0.0
    promoted_seconds: float = 0.0

    def add_in_place(self, count: int, nbytes: int, seconds: float) -> None:
        """Counts ``count`` hits read in place at that cost."""
        self.in_place += count
        self.in_place_bytes += nbytes
        self.in_place_seconds += seconds

    def add_promoted(self, count: int, nbytes: int, seconds: float) -> None:
        """Counts ``count`` hits promoted at that cost."""
        self.promoted += count
        self.promoted_bytes += nbytes
        self.promoted_seconds += seconds


def in_place_cost(engine: SimEngine, tier: int, count: int, transfers: int = 1) -> tuple[int, float]:
    """(bytes, seconds) of ``count`` hits read in place in ``tier`` in ``transfers`` reads: the
    move from the tier to HBM (nothing for hits in an HBM top tier)."""
    if (tier == 0 and engine.gpu_is_top) or not count:
        return 0, 0.0
    return engine.cost(tier, GPU, count, transfers)


def promoted_cost(engine: SimEngine, tier: int, count: int, transfers: int = 1) -> tuple[int, float]:
    """(bytes, seconds) of ``count`` hits of ``tier`` promoted in ``transfers`` moves: the move
    to the top tier, then, when the top tier is not HBM, the read from there to HBM; the bytes
    are those that reach HBM (the last hop's, as ``SimEngine.cost``)."""
    if not count:
        return 0, 0.0
    nbytes, seconds = engine.cost(tier, 0, count, transfers)
    if engine.gpu_is_top:
        return nbytes, seconds
    nbytes, onward = engine.cost(0, GPU, count, transfers)
    return nbytes, seconds + onward


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
        """Charges one ``HIT`` event of ``count`` blocks in ``tier``: the promotion it followed
        (the move was booked when submitted; the read on to HBM is booked here), or a read
        in place, booked here (free in an HBM top tier)."""
        cost, engine = self.costs[tier], self.engine
        kind, source, _, destination = previous
        if read_in_place(kind, source, tier):
            if tier or not engine.gpu_is_top:
                engine.read_through(tier, count)
            cost.add_in_place(count, *in_place_cost(engine, tier, count))
        elif kind == Ev.PROMOTE and source == tier and destination == 0:
            if not engine.gpu_is_top:
                engine.read_through(0, count)
            cost.add_promoted(count, *promoted_cost(engine, tier, count))
        else:
            raise AssertionError(f"{count} hit(s) in tier {tier} were neither promoted nor read in place")
