"""Placement ``top``: new blocks and every hit below go to the top tier (the default)."""

from __future__ import annotations

from typing import Sequence

from .base import Hints, PlacementPolicy


class TopPlacement(PlacementPolicy):
    """Stores new blocks in the top tier and promotes every hit found below to it, as vLLM's
    and SGLang's offloading do (a block is loaded back into HBM to be read). Stateless."""

    name = "top"

    def insert_tier(self, ids: Sequence[int], hints: Hints | None = None) -> int:
        return 0

    def promote_tier(self, ids: Sequence[int], tier: int, hints: Hints | None = None) -> int:
        return 0
