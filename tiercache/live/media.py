"""Opening and checking the media of a live store's tiers."""

from __future__ import annotations

import os
from typing import Sequence

from tiercache.config import KVLayout, TierConfig
from tiercache.data.nvme import NVMeStore
from tiercache.data.pools import BlockPool, dram_pool, hbm_pool
from tiercache.errors import UserError
from tiercache.policies import get_eviction

__all__ = ["check_tiers", "check_online", "open_medium"]

_ORDER = ("hbm", "dram", "nvme")


def check_tiers(tiers: Sequence[TierConfig], path) -> None:
    """Tiers must be ``hbm[, dram][, nvme]`` in that order; NVMe needs a directory.

    Raises:
        UserError: naming what is wrong.
    """
    names = [t.name for t in tiers]
    if not tiers or names[0] != "hbm" or any(n not in _ORDER for n in names) \
            or names != sorted(names, key=_ORDER.index) or len(set(names)) != len(names):
        raise UserError(f"TieredKVStore: tiers must be hbm[, dram][, nvme] in that order, got {names}")
    if "nvme" in names and path is None:
        raise UserError("TieredKVStore: an nvme tier needs path= (the store directory)")
    if path is not None and os.path.isfile(path):
        raise UserError(f"TieredKVStore: store path {os.fspath(path)!r} is a file")


def check_online(eviction: str | None, tiers: Sequence[TierConfig]) -> None:
    """A live store cannot know the future: offline policies (Belady) are refused."""
    for name in {eviction} if eviction else {t.eviction for t in tiers}:
        if get_eviction(name).needs_future:
            raise UserError(f"TieredKVStore: eviction policy {name!r} needs the future (offline only); use it in tiercache replay")


def open_medium(tier: TierConfig, layout: KVLayout, path, device) -> BlockPool | NVMeStore:
    """The medium of one tier: a GPU (or CPU) pool, a pinned host pool, or an NVMe store."""
    if tier.name == "hbm":
        return hbm_pool(layout, tier.capacity_blocks, device)
    if tier.name == "dram":
        return dram_pool(layout, tier.capacity_blocks)
    return NVMeStore(path, layout, tier.capacity_blocks)
