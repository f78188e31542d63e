"""A block read up out of NVMe keeps its durable copy there (``RetainedCopies``).

In the exclusive hierarchy a promotion takes a block out of the NVMe tier, but its chunk and
index entry stay valid (a key names its content). The store keeps them until the block comes
back down (taken up again, no write), leaves the hierarchy, or the manager needs the slot:
so a full disk at close, or a flush the store makes on its own to recycle slots, never makes
the deletion of a block's only durable copy durable while the block was merely read.
A "kill" here is a copy of the store directory: what is on disk, without the unflushed index.
"""

from __future__ import annotations

import shutil

import torch

from store_helpers import LAYOUT, blocks, key, tiers
from test_close_persist_errors import chunk_writes_fail_after
from tiercache.config import TierConfig
from tiercache.data.nvme import NVMeStore
from tiercache.live.store import TieredKVStore


def reopened(path, tier_list, data: torch.Tensor) -> list[int]:
    """The blocks a reopened store holds, each checked bit for bit against ``data``."""
    keys = [key(i) for i in range(len(data))]
    with TieredKVStore(LAYOUT, tier_list, path=path, device="cpu") as again:
        again.check_invariants()
        held = [i for i, tier in enumerate(again.lookup(keys)[1]) if tier is not None]
        for i in held:
            assert torch.equal(again.get([key(i)])[0], data[i]), f"block {i} reopened with other bytes"
        again.close(persist=False)
    return held


def killed(path, tmp_path):
    """What a kill -9 of the store open at ``path`` now would leave: a copy of its directory."""
    crash = tmp_path / "crash"
    shutil.copytree(path, crash)
    return crash


def test_blocks_read_on_a_full_disk_reopen_after_close(tmp_path, monkeypatch):
    """12 blocks durable on NVMe, the disk then full: reading 5 of them (promoted to HBM and
    DRAM) and closing loses none: their NVMe copies are taken up again, with no write."""
    path, data = tmp_path / "nvme", blocks(12, 7)
    with TieredKVStore(LAYOUT, tiers(), path=path, device="cpu") as store:
        store.put([key(i) for i in range(12)], data)
    store = TieredKVStore(LAYOUT, tiers(), path=path, device="cpu")
    assert store.lookup([key(i) for i in range(12)])[1] == ["nvme"] * 12
    chunk_writes_fail_after(monkeypatch, landed=0)  # the disk is full for chunks
    for i in range(5):
        assert torch.equal(store.get([key(i)])[0], data[i])
    assert "nvme" not in store.lookup([key(i) for i in range(5)])[1]
    store.check_invariants()
    assert store.close() == 5  # taken up again: no PersistError
    monkeypatch.undo()
    assert reopened(path, tiers(), data) == list(range(12))


def test_a_read_block_keeps_its_nvme_copy_through_close_without_persist(tmp_path):
    """``close(persist=False)`` persists nothing held only in HBM/DRAM, but a block read up out
    of NVMe was durable: it goes back onto its retained copy (no write), as a killed process
    would leave it (probe Q33: its copy used to be deleted, so the close lost it)."""
    path, data = tmp_path / "nvme", blocks(12, 8)
    with TieredKVStore(LAYOUT, tiers(), path=path, device="cpu") as store:
        store.put([key(i) for i in range(12)], data)
    store = TieredKVStore(LAYOUT, tiers(), path=path, device="cpu")
    store.get([key(0), key(1)])
    store.close(persist=False)
    assert reopened(path, tiers(), data) == list(range(12))


SMALL = [TierConfig("hbm", 1), TierConfig("nvme", 4)]


def small_store(path) -> TieredKVStore:
    """HBM of 1 block over an NVMe tier of 4 whose store has one spare slot, so the store
    must flush on its own to recycle slots as soon as a block leaves NVMe."""
    NVMeStore(path, LAYOUT, 5).close()
    return TieredKVStore(LAYOUT, SMALL, eviction="lru", path=path, device="cpu")


def test_a_block_moved_up_and_back_down_in_one_call_survives_a_kill(tmp_path):
    """Block 3 is on NVMe at the flush; one ``access`` promotes it, stores new blocks (whose
    demotions make the store flush to recycle slots) and pushes it back down; a kill after
    that call must find it."""
    path, data = tmp_path / "nvme", blocks(13, 9)
    store = small_store(path)
    for i in range(5):
        store.put([key(i)], data[i : i + 1])
    store.flush()
    assert store.lookup([key(3)])[1] == ["nvme"]
    ids = [10, 11, 3, 12]
    store.access([key(i) for i in ids], data[ids])
    assert store.lookup([key(3)])[1] == ["nvme"]
    store.check_invariants()
    assert len(store._media[1]) <= 4  # retained copies never outnumber the tier's free slots
    held = reopened(killed(path, tmp_path), SMALL, data)
    store.close(persist=False)
    assert 3 in held


def test_a_block_evicted_and_stored_again_in_one_call_survives_a_kill(tmp_path):
    """Block 29 is on NVMe at the last flush and after the last call; during that call its
    retained copy was deleted for room and a flush to recycle slots made that durable before
    it came back down: its new copy is flushed before it counts as back in the tier, so a
    kill then finds it."""
    path, data = tmp_path / "nvme", blocks(30, 3)
    store = small_store(path)
    steps = [("put", [11, 29]), ("get", [11, 29]), ("flush", []), ("access", [6, 22]), ("access", [12, 20, 27, 4]),
             ("put", [27, 29]), ("access", [21]), ("prefetch", [20, 27]), ("put", [26]), ("flush", [])]
    for op, ids in steps:
        keys = [key(i) for i in ids]
        if op == "flush":
            store.flush()
        elif op == "get":
            store.get(keys)
        elif op == "prefetch":
            store.wait(store.prefetch(keys))
        else:
            getattr(store, op)(keys, data[ids])
    assert store.lookup([key(29)])[1] == ["nvme"]
    ids = [22, 25, 29, 13]
    store.access([key(i) for i in ids], data[ids])
    assert store.lookup([key(29)])[1] == ["nvme"]
    store.check_invariants()
    held = reopened(killed(path, tmp_path), SMALL, data)
    store.close(persist=False)
    assert 29 in held


def test_read_blocks_survive_a_full_disk_close_that_also_has_new_blocks(tmp_path, monkeypatch):
    """The probe's case: 10 blocks fill a 10-slot NVMe tier, the disk is full, 4 new blocks
    are put and 4 durable ones read (to HBM; the new ones go down to DRAM, and NVMe keeps
    4 retained copies in its 4 free slots). Reserving NVMe slots for the new blocks first
    deleted the retained copies, then every write failed: the read blocks go back first now
    (no write), and the new ones are left out."""
    small, path, data = tiers(hbm=4, dram=4, nvme=10), tmp_path / "nvme", blocks(14, 9)
    with TieredKVStore(LAYOUT, small, path=path, device="cpu") as store:
        store.put([key(i) for i in range(10)], data[:10])
    store = TieredKVStore(LAYOUT, small, path=path, device="cpu")
    chunk_writes_fail_after(monkeypatch, landed=0)  # the disk is full for chunks
    store.put([key(i) for i in range(10, 14)], data[10:])
    assert torch.equal(store.get([key(i) for i in range(4)]), data[:4])
    assert store.lookup([key(i) for i in range(14)])[1] == ["hbm"] * 4 + ["nvme"] * 6 + ["dram"] * 4
    store.check_invariants()
    assert store.close() == 4  # the read blocks: taken up again; the new ones did not fit
    monkeypatch.undo()
    assert reopened(path, small, data[:10]) == list(range(10))
