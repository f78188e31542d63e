"""Probe Q51: a write-through store never drops a block whose copy down failed.

With ``write_through=True`` every tier's victims are dropped, each having a copy below.
A block whose copy down to NVMe failed (a full disk for one put) had none, yet was dropped
as an ordinary DRAM eviction once later puts pushed it out of HBM and DRAM, while NVMe had
free slots: silently lost, missing after a reopen too. Such a victim now moves down as an
exclusive tier's victim does; while the disk stays full, placements that would need it to
leave are refused instead (counted), and no stored block is lost.
"""

from __future__ import annotations

import errno

import torch

from store_helpers import LAYOUT, blocks, key
from tiercache.config import TierConfig
from tiercache.data.nvme import NVMeStore
from tiercache.live.store import TieredKVStore

TIERS = [TierConfig("hbm", 2), TierConfig("dram", 2), TierConfig("nvme", 64)]


def _full_disk(monkeypatch) -> dict:
    """NVMe chunk writes fail with ENOSPC while ``state["full"]``."""
    real, state = NVMeStore._write_chunk, {"full": False}

    def write_chunk(self, *args, **kwargs):
        if state["full"]:
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(NVMeStore, "_write_chunk", write_chunk)
    return state


def test_a_block_whose_copy_down_failed_moves_down_when_pushed_out(tmp_path, monkeypatch):
    state = _full_disk(monkeypatch)
    store = TieredKVStore(LAYOUT, TIERS, path=tmp_path, device="cpu", write_through=True)
    data = blocks(8, 3)
    state["full"] = True
    assert store.put([key(0)], data[0:1]) == 1
    assert store.stats()["nvme"]["failed_writes"] == 1
    state["full"] = False  # room again
    for i in range(1, 8):  # push key 0 out of HBM and DRAM
        assert store.put([key(i)], data[i : i + 1]) == 1
    assert store.lookup([key(0)])[1] == ["nvme"]
    assert torch.equal(store.get([key(i) for i in range(8)]), data)
    store.close()
    reopened = TieredKVStore(LAYOUT, TIERS, path=tmp_path, device="cpu", write_through=True)
    assert torch.equal(reopened.get([key(i) for i in range(8)]), data)
    reopened.close()


def test_while_the_disk_stays_full_puts_are_refused_and_no_stored_block_is_lost(tmp_path, monkeypatch):
    state = _full_disk(monkeypatch)
    store = TieredKVStore(LAYOUT, TIERS, path=tmp_path, device="cpu", write_through=True)
    data = blocks(10, 4)
    state["full"] = True
    stored = [i for i in range(10) if store.put([key(i)], data[i : i + 1]) == 1]
    assert 0 < len(stored) < 10  # HBM and DRAM hold what they can; the rest is refused, counted
    assert store.lookup([key(i) for i in stored])[0] == len(stored)
    assert torch.equal(store.get([key(i) for i in stored]), data[stored])
    state["full"] = False
    for i in range(10, 20):  # room again: the stranded blocks move down as others arrive
        store.put([key(i)], blocks(1, 100 + i))
    assert torch.equal(store.get([key(i) for i in stored]), data[stored])
    store.check_invariants()
    store.close()


def test_a_last_tier_full_of_held_blocks_is_no_failed_copy(tmp_path):
    """Review R31: a copy down declined for want of room (NVMe full of a live sequence's held
    blocks) is a state, not a failure. Noting it made those blocks unable to leave, HBM then
    filled with held blocks without a lower copy, and every later insert was refused."""
    from tiercache.core.manager import TierManager
    from tiercache.core.plans import Ev
    from tiercache.policies import make_admission, make_eviction

    caps = [2, 2, 2]
    manager = TierManager(list(zip(("hbm", "dram", "nvme"), caps)), [make_eviction("lru", c) for c in caps],
                          [make_admission("always") for _ in caps], write_through=True)
    for block, hold in ((0, True), (1, True), (2, False), (3, False), (4, True), (5, True)):
        manager.insert([block], hold=hold)
    manager.unhold([0, 1])
    manager.events.drain()
    for block in range(6, 10):
        manager.insert([block])
        manager.check_invariants()
    assert not [e for e in manager.events.drain() if e[0] == Ev.REFUSED]
    assert manager.locate(9) == 0
