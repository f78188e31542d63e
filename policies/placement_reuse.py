"""Placement ``reuse``: the top tier holds blocks that were reused; new blocks start one tier down."""

from __future__ import annotations

from typing import Sequence

from .base import Hints, PlacementPolicy


class ReusePlacement(PlacementPolicy):
    """New blocks are stored in the second tier; a block reaches the top tier when it is hit.

    In a prefix cache most new blocks are never read again (58% of the bundled Mooncake
    sample's blocks are seen once), so a top tier that takes every new block spends most of
    its room on one-offs, and the reused blocks it pushes down are then served from slower
    tiers. With the modeled TTFT of a hit ``prefill time saved - load time``, a hit from HBM
    saves the most; this placement keeps HBM for blocks that have proved reusable: it is the
    protected segment of a segmented LRU (SLRU, Karedla et al., 1994; 2Q's Am queue, Johnson
    & Shasha, 1994) laid over the hierarchy's tiers, with the second tier as probation.

    Departures: the segments are whole tiers with their own eviction policies (the hierarchy's
    demotion chain moves a top-tier victim down, where it is probation again); a single-tier
    hierarchy places everything in its one tier. The new block's write from the top tier to
    the second one is charged on that link in a replay (it runs after the request, off the
    TTFT path, as a demotion does).
    """

    name = "reuse"

    def insert_tier(self, ids: Sequence[int], hints: Hints | None = None) -> int:
        return 1 if self.n_tiers > 1 else 0

    def promote_tier(self, ids: Sequence[int], tier: int, hints: Hints | None = None) -> int:
        return 0
