"""Probe Q71 (open/close churn of stores, decode caches, transformers caches and in-process
replays: no file descriptor, thread, mmap, finalizer or shared-memory segment accumulates):
a store dropped without ``close`` was in reference cycles (the engine's copy context held the
engine's own method; its retention callbacks held the store), so it kept its lock, journal
and I/O threads until the cycle collector ran: a reopen of its path was refused until then."""

from __future__ import annotations

import gc
import time
import warnings
import weakref

import pytest
import torch

from store_helpers import LAYOUT, blocks, key, tiers
from tiercache import TieredKVCache
from tiercache.live.store import TieredKVStore


@pytest.fixture
def no_cycle_collector():
    """Only reference counting frees what is dropped (as between two automatic collections)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def freed_soon(ref: weakref.ref, within_s: float = 10.0) -> bool:
    """Whether ``ref``'s object is freed within ``within_s``: an I/O thread finishing a write the
    dropped store had started still holds it until that task returns (reference counting then
    frees it in that thread); an object held in a cycle is never freed with the collector off."""
    deadline = time.monotonic() + within_s
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    return ref() is None


def test_a_dropped_store_releases_its_path_at_once(tmp_path, no_cycle_collector):
    path = tmp_path / "nvme"
    store = TieredKVStore(LAYOUT, tiers(hbm=2, dram=2, nvme=16), path=path, device="cpu")
    store.put([key(i) for i in range(6)], blocks(6, 1))
    nvme = weakref.ref(store._media[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # "was not closed", as the README says
        del store
    assert freed_soon(nvme)  # by reference counting alone: its lock, journal and threads released
    with TieredKVStore(LAYOUT, tiers(hbm=2, dram=2, nvme=16), path=path, device="cpu") as reopened:
        reopened.check_invariants()  # the path was released: it opens (refused before, until a collection)


def test_a_dropped_decode_cache_releases_its_path_at_once(tmp_path, no_cycle_collector):
    from tiercache.config import TierConfig

    layout_tiers = [TierConfig("hbm", 2), TierConfig("dram", 2), TierConfig("nvme", 64)]
    cache = TieredKVCache(LAYOUT, layout_tiers, path=tmp_path / "nvme", device="cpu")
    nvme = weakref.ref(cache.store._media[-1])
    seq = cache.sequence(tokens=list(range(9)))
    for layer in range(LAYOUT.layers):
        seq.append(layer, torch.randn(LAYOUT.kv_heads, 9, LAYOUT.head_dim).half(),
                   torch.randn(LAYOUT.kv_heads, 9, LAYOUT.head_dim).half())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        del seq, cache
    assert freed_soon(nvme)
    TieredKVCache(LAYOUT, layout_tiers, path=tmp_path / "nvme", device="cpu").close()
