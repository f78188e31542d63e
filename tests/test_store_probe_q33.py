"""Probe Q33 (crash, full disk and close of the NVMe tier). Finding 1: ``close(persist=False)``
deleted the NVMe copies of blocks that had only been read up out of NVMe (``RetainedCopies.
drop_all``): a store of 20 durable blocks, 4 of them read, reopened with 16 (a SIGKILL at the
same point kept all 20), and a decode cache whose prompt was read back lost layer 1 of its
first positions, serving 0 of 40 blocks. Such blocks now go back onto their NVMe copies
(``lifecycle.keep_retained``: no write). Finding 2: a ``PersistError`` did not name the store."""

from __future__ import annotations

import torch

from store_helpers import LAYOUT, blocks, key, tiers
from test_close_persist_errors import filled_store
from test_decode_probe_r19 import PROMPT, _cache, _prefill, _serves_what_was_written
from test_nvme_faults import fail_next
from tiercache.live.store import PersistError, TieredKVStore

import pytest


def test_blocks_only_read_keep_their_nvme_copies_through_close_without_persist(tmp_path):
    path, data = tmp_path / "nvme", blocks(20, 33)
    with TieredKVStore(LAYOUT, tiers(hbm=4, dram=4, nvme=64), path=path) as store:
        store.put([key(i) for i in range(20)], data)
    store = TieredKVStore(LAYOUT, tiers(hbm=4, dram=4, nvme=64), path=path)
    assert torch.equal(store.get([key(i) for i in range(4)]), data[:4])  # read up into HBM
    assert store.close(persist=False) == 0  # nothing persisted: the blocks were NVMe's already
    with TieredKVStore(LAYOUT, tiers(hbm=4, dram=4, nvme=64), path=path) as again:
        again.check_invariants()
        assert all(tier == "nvme" for tier in again.lookup([key(i) for i in range(20)])[1])
        assert torch.equal(again.get([key(i) for i in range(20)]), data)


def test_close_without_persist_still_drops_what_only_hbm_and_dram_held(tmp_path):
    path, data = tmp_path / "nvme", blocks(6, 34)
    with TieredKVStore(LAYOUT, tiers(hbm=4, dram=4, nvme=64), path=path) as store:
        store.put([key(i) for i in range(2)], data[:2])
    store = TieredKVStore(LAYOUT, tiers(hbm=4, dram=4, nvme=64), path=path)
    store.get([key(0)])
    store.put([key(i) for i in range(2, 6)], data[2:])  # never on NVMe
    store.close(persist=False)
    with TieredKVStore(LAYOUT, tiers(hbm=4, dram=4, nvme=64), path=path) as again:
        where = again.lookup([key(i) for i in range(6)])[1]
        assert where == ["nvme", "nvme", None, None, None, None]
        assert torch.equal(again.get([key(0), key(1)]), data[:2])


def test_a_decode_cache_whose_prompt_was_read_back_serves_it_after_close_without_persist(tmp_path):
    path = tmp_path / "nvme"
    cache = _cache(path, hbm=16, dram=16, nvme=64)
    kv = _prefill(cache, PROMPT)
    cache.close()
    cache = _cache(path, hbm=16, dram=16, nvme=64)
    assert _serves_what_was_written(cache, PROMPT, kv) == len(PROMPT)  # read up: copies retained
    cache.close(persist=False)
    cache = _cache(path, hbm=16, dram=16, nvme=64)
    assert _serves_what_was_written(cache, PROMPT, kv) == len(PROMPT)
    cache.close()


def test_a_persist_error_names_the_nvme_store(tmp_path, monkeypatch):
    path = tmp_path / "nvme"
    store, *_ = filled_store(path)
    fail_next(monkeypatch, "pwrite", count=10**6)  # the disk is full: every write fails
    with pytest.raises(PersistError) as caught:
        store.close()
    monkeypatch.undo()
    assert f"({path}: " in str(caught.value) and caught.value.reason.startswith(f"{path}: ")
