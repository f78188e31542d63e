"""Probe CR1's findings on the tier manager's move machinery.

1. A copy that keeps its source (a publish into the shared tier) pinned a block a move in
   flight (a prefetch) was taking out of its tier; the move's completion then raised
   CountError half-way (plan gone, slot leaked, policy out of step with the tier).
2. ``release([K, K])`` was refused although K was pinned twice: once on the block lost, once
   on the block stored again (refs now spend orphan counts first, per repeat, as holds do).
3. A write-through store's ``close(persist=True)`` dropped the blocks whose copy down to NVMe
   had failed, silently.
4. ``check_invariants`` failed on a healthy store while a prefetch of a corrupt NVMe block was
   in flight.

The live remote test starts a Mooncake master on loopback (skips without Mooncake).
"""

from __future__ import annotations

import errno
import time

import pytest
import torch

from store_helpers import LAYOUT, blocks, key
from tiercache.config import TierConfig
from tiercache.core.counts import CountError
from tiercache.core.manager import TierManager
from tiercache.core.plans import Ev, EventLog, JobResult
from tiercache.data.nvme import NVMeStore
from tiercache.live.store import PersistError, TieredKVStore
from tiercache.policies import make_admission, make_eviction


class DeferredEngine:
    """Jobs finish only when waited for or polled (a move stays in flight meanwhile)."""

    def __init__(self) -> None:
        self.jobs: dict[int, object] = {}

    def submit(self, plan) -> None:
        self.jobs[plan.job_id] = plan

    def poll(self) -> list[JobResult]:
        done = [JobResult(job_id) for job_id in self.jobs]
        self.jobs.clear()
        return done

    def wait(self, job_id: int) -> JobResult:
        self.jobs.pop(job_id)
        return JobResult(job_id)

    def fill(self, tier, ids, slots) -> None:
        pass

    def discard(self, tier, ids, slots) -> None:
        pass


def shared_manager(events: EventLog | None = None) -> TierManager:
    """hbm 2, dram 4, a shared remote tier of 8; block 1 in DRAM, 2 and 3 in HBM."""
    tiers = [("hbm", 2), ("dram", 4), ("remote", 8)]
    m = TierManager(tiers, [make_eviction("lru", c) for _, c in tiers], [make_admission("always") for _ in tiers],
                    engine=DeferredEngine(), events=events, shared_last=True)
    m.insert([1, 2, 3])
    m.wait_all()
    assert [sorted(d.slot_of) for d in m.dirs] == [[2, 3], [1], []]
    return m


# -- 1: a copy never takes a block a move in flight owns ------------------------------------
def test_a_publish_skips_a_block_a_prefetch_is_moving_and_the_move_completes_whole():
    m = shared_manager()
    (move,) = m.prefetch([1])  # dram -> hbm, in flight: 1 pinned in dram
    assert m.publish([1]) == []  # the copy would read a block about to leave dram
    assert m.prepare_move([1], 1, 2, keep_source=True) is None
    assert [r.ok for r in m.wait_all()] == [True]
    assert m.locate(1) == 0 and not m.inflight and not m.dirs[0].reserved
    m.check_invariants()
    (copy,) = m.publish([1])  # once the move landed, it publishes from where the block is
    assert (copy.src_tier, copy.dst_tier, copy.keep_source) == (0, 2, True)
    m.wait_all()
    assert 1 in m.dirs[0].slot_of and 1 in m.dirs[2].slot_of
    m.check_invariants()


def test_copies_may_share_a_source_with_other_copies():
    m = shared_manager()
    assert m.prepare_move([1], 1, 2, keep_source=True) is not None  # a copy in flight (pins 1)
    assert m.publish([1]) == []  # already on its way into the shared tier
    assert m.prefetch([1]) == []  # a move never takes a block a copy reads


def test_a_move_whose_source_is_still_read_is_taken_back_whole():
    events = EventLog()
    m = shared_manager(events)
    (move,) = m.prefetch([1])
    events.drain()
    m.dirs[1].pin([1])  # another transfer reading 1 in dram (prepare_move never admits it)
    result = m.wait(move.job_id)
    assert not result.ok and "still read by another transfer" in result.error
    assert [e[0] for e in events.drain()] == [Ev.TRANSFER_FAILED]
    assert not m.inflight and m.dirs[0].reserved == set() and m.dirs[0].n_free == 1  # the room made stays free
    assert m.locate(1) == 1 and m.dirs[1].pins == {1: 1}
    m.dirs[1].unpin([1])
    m.check_invariants()


def test_a_selective_publish_of_a_prefetched_block_reads_the_right_bytes():
    """Live: the read that makes a block hot enough waits for its prefetch, then publishes."""
    from remote_helpers import remote_config, require_mooncake

    require_mooncake()
    from tiercache.config import RemoteWrite
    from tiercache.data.remote_master import start_master

    master = start_master()
    try:
        config = remote_config(master, write=RemoteWrite.SELECTIVE, write_hits=2)
        tiers = [TierConfig("hbm", 2), TierConfig("dram", 4), TierConfig("remote", 64, remote=config)]
        store = TieredKVStore(LAYOUT, tiers, device="cpu")
        keys, data = [key(i) for i in range(4)], blocks(4, 7)
        store.put(keys, data)
        assert store.lookup(keys)[1][0] == "dram"
        assert store.prefetch(keys[:1]).blocks == 1  # hit 1, move left in flight
        assert torch.equal(store.get(keys[:1]), data[:1])  # hit 2: published from HBM
        store.check_invariants()
        assert store.stats()["remote"]["publish_queued"] == 1
        assert torch.equal(store.get(keys[:1]), data[:1])
        store.check_invariants()
        store.close()
    finally:
        master.stop()


# -- 2: refs spend orphan counts first, per repeat ------------------------------------------
def test_unref_spends_the_orphan_reference_then_the_live_one():
    m = shared_manager()
    m.ref([1])
    m.report_lost(1, [1])  # its copy proved unreadable while referenced
    assert m.orphan_refs == {1: 1} and m.locate(1) is None
    m.insert([1])  # stored anew
    m.ref([1])
    with pytest.raises(CountError):
        m.unref([1, 1, 1])  # one more than the two pins: nothing changes
    assert (m.orphan_refs, m.refs) == ({1: 1}, {1: 1})
    m.unref([1, 1])
    assert (m.orphan_refs, m.refs) == ({}, {})
    m.check_invariants()


def test_release_of_a_key_pinned_before_its_loss_and_after_it_is_stored_again(tmp_path, monkeypatch):
    store = TieredKVStore(LAYOUT, [TierConfig("hbm", 1), TierConfig("nvme", 8)], path=tmp_path, device="cpu")
    k, j, data = key(1), key(2), blocks(2, 3)
    store.put([k], data[:1])
    store.put([j], data[1:])  # k demoted to nvme
    store.pin([k])
    with monkeypatch.context() as patch:
        patch.setattr(NVMeStore, "_read_verified", lambda self, entry, dest: False)  # every chunk corrupt
        with pytest.raises(KeyError, match="unreadable"):
            store.get([k])
    store.put([k], data[:1])
    store.pin([k])
    with pytest.raises(CountError, match=k.hex()):
        store.release([k, k, k])  # three releases, two pins: nothing changes
    store.release([k, k])
    assert store.manager.refs == {} and store.manager.orphan_refs == {}
    with pytest.raises(CountError):
        store.release([k])
    store.check_invariants()
    store.close()


# -- 3: a write-through persist writes the blocks with no NVMe copy -------------------------
def _write_through_store_whose_copies_down_failed(path, monkeypatch, n: int = 3):
    tiers = [TierConfig("hbm", 4), TierConfig("dram", 4), TierConfig("nvme", 8)]
    store = TieredKVStore(LAYOUT, tiers, path=path, device="cpu", write_through=True)
    real, state = NVMeStore._write_chunk, {"full": True}

    def write_chunk(self, *args, **kwargs):
        if state["full"]:
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(NVMeStore, "_write_chunk", write_chunk)
    keys, data = [key(i) for i in range(n)], blocks(n, 11)
    assert store.put(keys, data) == n
    assert store.lookup(keys)[1] == ["hbm"] * n and store.manager.dirs[2].n_free == 8
    return store, tiers, keys, data, state


def test_a_write_through_close_persists_blocks_whose_copy_down_failed(tmp_path, monkeypatch):
    store, tiers, keys, data, state = _write_through_store_whose_copies_down_failed(tmp_path, monkeypatch)
    state["full"] = False  # the disk has room again
    assert store.close(persist=True) == 3
    reopened = TieredKVStore(LAYOUT, tiers, path=tmp_path, device="cpu", write_through=True)
    assert reopened.lookup(keys) == (3, ["nvme"] * 3)
    assert torch.equal(reopened.get(keys), data)
    reopened.close()


def test_a_write_through_close_that_cannot_write_them_raises_persist_error(tmp_path, monkeypatch):
    store, tiers, keys, _, _ = _write_through_store_whose_copies_down_failed(tmp_path, monkeypatch)
    with pytest.raises(PersistError) as raised:
        store.close(persist=True)  # the disk is still full
    assert (raised.value.saved, raised.value.failed, raised.value.left_out) == (0, 3, 0)
    monkeypatch.undo()
    reopened = TieredKVStore(LAYOUT, tiers, path=tmp_path, device="cpu", write_through=True)
    assert reopened.lookup(keys) == (0, [None] * 3)
    reopened.close()


def test_a_write_through_close_writes_nothing_twice(tmp_path):
    tiers = [TierConfig("hbm", 2), TierConfig("dram", 4), TierConfig("nvme", 8)]
    store = TieredKVStore(LAYOUT, tiers, path=tmp_path, device="cpu", write_through=True)
    keys, data = [key(i) for i in range(4)], blocks(4, 5)
    store.put(keys, data)  # every block copied down to DRAM and NVMe
    assert store.close(persist=True) == 0  # every block has its NVMe copy: none held only above
    reopened = TieredKVStore(LAYOUT, tiers, path=tmp_path, device="cpu", write_through=True)
    assert torch.equal(reopened.get(keys), data)
    reopened.close()


# -- 4: the invariant check tolerates a corrupt source of a read in flight ------------------
def test_check_invariants_holds_while_a_prefetch_of_a_corrupt_block_is_in_flight(tmp_path, monkeypatch):
    tiers = [TierConfig("hbm", 1), TierConfig("dram", 1), TierConfig("nvme", 8)]
    store = TieredKVStore(LAYOUT, tiers, path=tmp_path, device="cpu")
    keys = [key(i) for i in range(3)]
    store.put(keys, blocks(3, 9))
    assert store.lookup(keys)[1] == ["nvme", "dram", "hbm"]
    monkeypatch.setattr(NVMeStore, "_read_verified", lambda self, entry, dest: False)
    nvme = store._media[2]
    assert store.prefetch(keys[:1]).blocks == 1
    deadline = time.monotonic() + 30
    while nvme.contains(keys[0]) and time.monotonic() < deadline:  # the I/O thread deletes the corrupt chunk
        time.sleep(0.01)
    assert not nvme.contains(keys[0]) and len(store.manager.inflight) == 1
    store.check_invariants()  # the source of the read in flight is exempt
    store.wait()
    assert store.lookup(keys[:1]) == (0, [None])
    store.check_invariants()
    store.close()
