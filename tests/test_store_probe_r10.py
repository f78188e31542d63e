"""Probe R10: reads that meet a block a move in flight finds corrupt on NVMe.

A read (``get``, ``get_prefix``, ``get_slots``) completes the moves in flight before it
looks its keys up, so a block a prefetch found unreadable is reported as any lost key is
(naming the caller's key, never an internal id), and the key map stays exact.
"""

from __future__ import annotations

import pytest
import torch

from tiercache.config import TierConfig
from tiercache.data.nvme import NVMeStore
from tiercache.live.store import TieredKVStore

from store_helpers import LAYOUT, blocks, key


def _store_with_corrupt_prefetch(path, monkeypatch):
    """A store whose oldest block (on NVMe) has a prefetch in flight that will find its chunk corrupt."""
    tiers = [TierConfig("hbm", 1), TierConfig("dram", 1), TierConfig("nvme", 8)]
    store = TieredKVStore(LAYOUT, tiers, path=path, device="cpu")
    keys, data = [key(i) for i in range(3)], blocks(3, 9)
    store.put(keys, data)
    assert store.lookup(keys)[1] == ["nvme", "dram", "hbm"]
    monkeypatch.setattr(NVMeStore, "_read_verified", lambda self, entry, dest: False)  # every chunk reads corrupt
    assert store.prefetch(keys[:1]).blocks == 1
    return store, keys, data


def test_get_of_a_block_its_prefetch_found_corrupt_names_the_key(tmp_path, monkeypatch):
    store, keys, _ = _store_with_corrupt_prefetch(tmp_path, monkeypatch)
    with pytest.raises(KeyError) as caught:
        store.get(keys[:1])
    message = str(caught.value)
    assert "1 of 1 keys are not stored" in message and keys[0].hex() in message
    assert "ref of block" not in message
    store.check_invariants()  # the key map holds exactly the resident blocks
    assert store.lookup(keys[:1]) == (0, [None])
    assert store.manager.refs == {} and store.manager.orphan_refs == {}
    store.close(persist=False)


def test_get_prefix_and_get_slots_after_a_corrupt_prefetch(tmp_path, monkeypatch):
    store, keys, data = _store_with_corrupt_prefetch(tmp_path, monkeypatch)
    out = store.get_prefix(keys)
    assert out.shape[0] == 0  # the first block is gone: the readable prefix is empty
    store.check_invariants()
    assert torch.equal(store.get(keys[2:]), data[2:])  # the others still read right
    store.close(persist=False)
    store, keys, _ = _store_with_corrupt_prefetch(tmp_path / "slots", monkeypatch)
    with pytest.raises(KeyError, match=keys[0].hex()):
        store.get_slots(keys[:1])
    store.check_invariants()
    assert store.manager.refs == {} and store.manager.orphan_refs == {}
    store.close(persist=False)
