"""A demotion into NVMe whose write fails keeps the retained copies it would have displaced.

A block read up out of NVMe leaves its stored copy there (``RetainedCopies``). A move into
NVMe that reserves the tier's last free slots displaces the oldest such copies: they used to
be deleted when the move started, so a write that then failed (a full disk) left their
blocks, still in HBM, with no durable copy: ``close(persist=True)`` on the still-full disk,
or a crash after any flush, lost them. They are deleted now only once the write succeeded.

The store here: 10 blocks durable on NVMe (a 10-block tier), 4 new blocks put, then 4 of
the durable ones read up to HBM (the new ones pushed down to DRAM): NVMe holds 6 blocks and
4 retained copies in its 4 free slots. The disk then fills and 4 more blocks are put: DRAM's
blocks must go down to NVMe, and that write fails. A "kill" is a copy of the store directory.
The last two tests use a store with one spare slot, fewer than the copies one demotion
displaces: the copy its room needs goes before the write, the others only once it landed.
"""

from __future__ import annotations

import errno
import os

import torch

from store_helpers import LAYOUT, blocks, key, tiers
from test_nvme_promote_durable import killed, reopened
from tiercache.config import TierConfig
from tiercache.data import chunkio
from tiercache.data.nvme import NVMeStore
from tiercache.keys import key_to_int
from tiercache.live.store import TieredKVStore

SMALL = tiers(hbm=4, dram=4, nvme=10)
READ, NEW, MORE = range(4), range(10, 14), range(14, 18)


def disk_full(monkeypatch) -> None:
    """Every chunk write fails with ENOSPC, new chunk files and in-place overwrites alike;
    the index journal still appends (its space is reserved ahead), so flushes succeed."""
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(chunkio, "write_chunk_file", full)
    monkeypatch.setattr(chunkio, "overwrite_chunk_file", full)


def keys(ids) -> list[bytes]:
    return [key(i) for i in ids]


def read_up(path, data: torch.Tensor, tier_list=SMALL) -> TieredKVStore:
    """The store described above, before the disk fills: ``READ`` in HBM, retained on NVMe."""
    with TieredKVStore(LAYOUT, tier_list, path=path, device="cpu") as store:
        store.put(keys(range(10)), data[:10])
    store = TieredKVStore(LAYOUT, tier_list, path=path, device="cpu")
    store.put(keys(NEW), data[NEW.start : NEW.stop])
    assert torch.equal(store.get(keys(READ)), data[:4])
    where = store.lookup(keys(range(14)))[1]
    assert where == ["hbm"] * 4 + ["nvme"] * 6 + ["dram"] * 4
    assert len(store.engine.retained.held_in(2)) == 4 and len(store._media[2]) == 10
    return store


def test_a_failed_demotion_leaves_the_copies_it_would_displace_retained(tmp_path, monkeypatch):
    """Before: the 4 copies were deleted for the failed write, close raised PersistError
    and the reopened store held 6 of the 10 blocks; now close takes the 4 up again."""
    path, data = tmp_path / "nvme", blocks(18, 5)
    store = read_up(path, data)
    retained = store.engine.retained.held_in(2)
    disk_full(monkeypatch)
    store.put(keys(MORE), data[MORE.start : MORE.stop])
    assert store._media[2].stats["failed_writes"] > 0  # the demotion into NVMe was tried, and failed
    assert store.lookup(keys(MORE))[1] == [None] * 4  # refused: no room was made for them
    assert store.engine.retained.held_in(2) == retained  # intact, still retained, oldest first (before: [])
    assert len(store._media[2]) == 10  # never more entries than the tier's capacity
    store.check_invariants()
    assert store.close() == 4  # the read blocks taken up again (no write); DRAM's 4 did not fit
    monkeypatch.undo()
    assert reopened(path, SMALL, data) == list(range(10))


def test_a_failed_demotion_then_a_flush_and_a_kill_loses_no_read_block(tmp_path, monkeypatch):
    """Before: the flush made the deletion of the 4 copies durable, and a kill lost them
    (the copy reopened with blocks 4-9 only)."""
    path, data = tmp_path / "nvme", blocks(18, 6)
    store = read_up(path, data)
    disk_full(monkeypatch)
    store.put(keys(MORE), data[MORE.start : MORE.stop])
    store.flush()
    crash = killed(path, tmp_path)
    store.close(persist=False)
    monkeypatch.undo()
    assert reopened(crash, SMALL, data) == list(range(10))


def test_a_demotion_that_writes_deletes_the_copies_it_displaced(tmp_path):
    """The disk has room: DRAM's 4 blocks land on NVMe, the 4 copies their room needed are
    deleted once they did, and a kill after a flush finds exactly the tier's 10 blocks."""
    path, data = tmp_path / "nvme", blocks(18, 7)
    store = read_up(path, data)
    store.put(keys(MORE), data[MORE.start : MORE.stop])
    where = store.lookup(keys(range(18)))[1]
    assert where.count("nvme") == 10 and all(where[i] == "nvme" for i in NEW)
    assert store.engine.retained.held_in(2) == [] and len(store._media[2]) == 10
    store.check_invariants()
    store.flush()
    crash = killed(path, tmp_path)
    store.close(persist=False)
    assert sorted(reopened(crash, SMALL, data)) == sorted(i for i in range(18) if where[i] == "nvme")


TIGHT = [TierConfig("hbm", 4), TierConfig("dram", 2), TierConfig("nvme", 4)]


def tight_store(path, data: torch.Tensor) -> TieredKVStore:
    """A 4-block NVMe tier over a store of 5 slots (one spare): 4 durable blocks, 2 new
    ones (in DRAM after the read), and the 4 read up to HBM, retained in NVMe's 4 free slots."""
    NVMeStore(path, LAYOUT, 5).close()
    with TieredKVStore(LAYOUT, TIGHT, eviction="lru", path=path, device="cpu") as store:
        store.put(keys(range(4)), data[:4])
    store = TieredKVStore(LAYOUT, TIGHT, eviction="lru", path=path, device="cpu")
    store.put(keys([10, 11]), data[[10, 11]])
    assert torch.equal(store.get(keys(range(4))), data[:4])
    assert store.lookup(keys([0, 1, 2, 3, 10, 11]))[1] == ["hbm"] * 4 + ["dram"] * 2
    assert len(store.engine.retained.held_in(2)) == 4
    return store


def test_more_displaced_copies_than_spare_slots_still_let_the_demotion_write(tmp_path):
    """DRAM's 2 blocks going down displace 2 copies, but the store has 1 spare slot: the
    one copy it needs is deleted before the write, and the demotion lands (not refused)."""
    path, data = tmp_path / "nvme", blocks(16, 8)
    store = tight_store(path, data)
    store.put(keys([14, 15]), data[[14, 15]])
    assert store.lookup(keys([10, 11, 0, 1, 2, 3, 14, 15]))[1] == ["nvme"] * 2 + ["dram"] * 2 + ["hbm"] * 4
    assert held(store) == [2, 3]  # 0 and 1 (the oldest) went: one before the write, one once it landed
    assert len(store._media[2]) == 4
    store.check_invariants()
    store.close(persist=False)


def test_with_one_spare_slot_a_failed_demotion_costs_only_the_copy_its_room_needed(tmp_path, monkeypatch):
    """The same on a full disk: of the 2 copies displaced, only the one the store had no
    physical slot beside was deleted before the write; the other is retained again."""
    path, data = tmp_path / "nvme", blocks(16, 9)
    store = tight_store(path, data)
    assert held(store) == [0, 1, 2, 3]
    disk_full(monkeypatch)
    store.put(keys([14, 15]), data[[14, 15]])
    assert store._media[2].stats["failed_writes"] > 0
    assert store.lookup(keys([10, 11]))[1] == ["dram", "dram"]
    assert held(store) == [1, 2, 3]  # before: [2, 3] (both displaced copies deleted for the failed write)
    store.check_invariants()
    store.flush()
    crash = killed(path, tmp_path)
    store.close(persist=False)
    monkeypatch.undo()
    assert reopened(crash, TIGHT, data) == [1, 2, 3]


def held(store: TieredKVStore) -> list[int]:
    """The test indices of the blocks whose copies the NVMe tier retains, oldest first."""
    index = {key_to_int(key(i)): i for i in range(32)}
    return [index[block_id] for block_id in store.engine.retained.held_in(2)]
