"""The live layer: handles of moves in flight, the key map invariant, copy handlers, rollbacks.

Fault injection and exact scenarios for what the architecture step changed: the store runs
no plan lifecycle of its own, keeps keys of exactly the resident blocks, publishes only what
landed, and moves bytes through one registered handler per medium pair.
"""

from __future__ import annotations

import errno
import threading

import numpy as np
import pytest
import torch

from store_helpers import LAYOUT, blocks, key, tiers
from tiercache.config import TierConfig
from tiercache.core.plans import JobResult, TransferPlan
from tiercache.data.engine import LocalEngine
from tiercache.data.handlers import HANDLERS, Job, handler_for, register_handler
from tiercache.data.nvme import NVMeStore
from tiercache.data.pools import BlockPool, dram_pool
from tiercache.errors import UserError
from tiercache.live.store import Pending, TieredKVStore

# -- handles of moves in flight --------------------------------------------------------------
def test_prefetch_then_any_other_call_then_get_and_close(tmp_path):
    """Whoever completes a prefetch (stats, put, poll), the handle never dangles."""
    data = blocks(8, 1)
    path = tmp_path / "nvme"
    store = TieredKVStore(LAYOUT, tiers(hbm=2, dram=2), path=path)
    store.put([key(i) for i in range(6)], data[:6])
    pending = store.prefetch([key(0), key(1)])
    assert isinstance(pending, Pending) and pending.blocks == 2 and len(pending.events) == len(pending.job_ids)
    store.stats()
    store.put([key(6), key(7)], data[6:])  # completes the prefetch as a side effect
    store.wait(pending)  # no-op now: already completed through the manager
    for i in range(8):
        assert torch.equal(store.get([key(i)])[0], data[i]), i
    store.check_invariants()
    assert store.close() >= 0
    with TieredKVStore(LAYOUT, tiers(hbm=2, dram=2), path=path) as again:
        assert again.lookup([key(i) for i in range(8)])[0] == 8


def test_access_can_return_with_promotions_in_flight(tmp_path):
    data = blocks(6, 2)
    with TieredKVStore(LAYOUT, tiers(hbm=2, dram=2), path=tmp_path / "nvme") as store:
        keys = [key(i) for i in range(6)]
        store.access(keys, data)
        assert store.lookup([key(0)])[1] == ["nvme"]
        pending = store.access([key(0)], data[:1], wait=False)
        assert pending and pending.blocks == 1
        store.check_invariants()
        store.wait(pending)
        assert store.lookup([key(0)])[1] == ["hbm"]
        assert not store.access([key(0)], data[:1], wait=False)  # an HBM hit moves nothing
        assert torch.equal(store.get([key(0)])[0], data[0])


# -- publish only what landed ------------------------------------------------------------------
def test_a_put_whose_copy_fails_leaves_no_trace(tmp_path, monkeypatch):
    """The copy into the top tier fails (probe Q57: the meta-device tensor this test used is
    now refused by the put's checks, before any copy, and ``pytest.raises(Exception)`` took
    that refusal for the copy's failure)."""
    path = tmp_path / "nvme"
    store = TieredKVStore(LAYOUT, tiers(), path=path)
    data = blocks(4, 3)
    store.put([key(i) for i in range(4)], data)

    def failed_copy(slots, blocks, non_blocking=False):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(store._media[0], "write", failed_copy)
    with pytest.raises(RuntimeError, match="copy failed"):
        store.put([key(10), key(11)], blocks(2, 5))
    monkeypatch.undo()
    assert store.lookup([key(10), key(11)])[1] == [None, None]
    store.check_invariants()
    store.close()  # HBM and DRAM blocks persisted to NVMe despite the failed put
    with TieredKVStore(LAYOUT, tiers(), path=path) as again:
        for i in range(4):
            assert torch.equal(again.get([key(i)])[0], data[i])


def test_an_interrupt_inside_the_copy_undoes_the_placement(tmp_path, monkeypatch):
    store = TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme")
    store.put([key(0)], blocks(1, 4))

    def interrupted(slots, blocks, non_blocking=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(store._media[0], "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.put([key(1), key(2)], blocks(2, 5))
    monkeypatch.undo()
    assert store.lookup([key(1), key(2)])[1] == [None, None]
    store.check_invariants()
    store.put([key(1)], blocks(1, 6))
    store.check_invariants()
    store.close()


def test_close_flushes_what_it_can_then_raises(tmp_path, monkeypatch):
    path = tmp_path / "nvme"
    store = TieredKVStore(LAYOUT, tiers(hbm=1, dram=1), path=path)
    data = blocks(6, 7)
    store.put([key(i) for i in range(6)], data)

    def broken():
        raise RuntimeError("persist failed")

    monkeypatch.setattr(store, "_persist", broken)
    with pytest.raises(RuntimeError, match="persist failed"):
        store.close()
    with TieredKVStore(LAYOUT, tiers(hbm=1, dram=1), path=path) as again:
        assert again.lookup([key(i) for i in range(4)])[0] == 4  # the NVMe blocks were flushed


# -- the key map equals the resident blocks ----------------------------------------------------
def test_keys_of_blocks_that_left_the_hierarchy_are_forgotten(tmp_path):
    with TieredKVStore(LAYOUT, tiers(hbm=2, dram=2, nvme=4), path=tmp_path / "nvme") as store:
        for start in range(0, 40, 4):
            store.put([key(i) for i in range(start, start + 4)], blocks(4, start))
            store.check_invariants()
        resident = sum(len(d) for d in store.manager.dirs)
        assert len(store._map.keys) == resident == 8


def test_the_invariant_catches_a_store_that_stops_forgetting(tmp_path, monkeypatch):
    with TieredKVStore(LAYOUT, tiers(hbm=2, dram=2, nvme=4), path=tmp_path / "nvme") as store:
        monkeypatch.setattr(store, "_forget_departed", lambda: None)
        for start in range(0, 20, 4):
            store.put([key(i) for i in range(start, start + 4)], blocks(4, start))
        with pytest.raises(AssertionError, match="non-resident"):
            store.check_invariants()


# -- copy handlers -----------------------------------------------------------------------------
def test_every_medium_pair_of_a_store_has_one_registered_handler(tmp_path):
    pool = dram_pool(LAYOUT, 2)
    with NVMeStore(tmp_path / "s", LAYOUT, 2) as nvme:
        assert type(handler_for(pool, pool)) is type(HANDLERS[(BlockPool, BlockPool)])
        assert type(handler_for(pool, nvme)) is type(HANDLERS[(BlockPool, NVMeStore)])
        assert type(handler_for(nvme, pool)) is type(HANDLERS[(NVMeStore, BlockPool)])
        with pytest.raises(TypeError, match="no copy handler for NVMeStore -> NVMeStore"):
            handler_for(nvme, nvme)


class DictMedium:
    """A toy medium (bytes kept in a dict by key): what a new tier has to provide."""

    keyed = True

    def __init__(self):
        self.blocks: dict[bytes, torch.Tensor] = {}

    def forget(self, keys):
        for k in keys:
            self.blocks.pop(k, None)


class PoolToDict:
    def start(self, plan, src, dst, ctx):
        for block_id, slot in zip(plan.ids, plan.src_slots):
            dst.blocks[ctx.key_of(block_id)] = src.view(int(slot)).clone()
        return Job(plan, result=JobResult(plan.job_id))


def test_a_new_medium_is_one_class_plus_one_registration(monkeypatch):
    monkeypatch.setattr("tiercache.data.handlers.HANDLERS", dict(HANDLERS))
    register_handler(BlockPool, DictMedium, PoolToDict())
    with pytest.raises(ValueError, match="already registered"):
        register_handler(BlockPool, DictMedium, PoolToDict())
    pool, medium = dram_pool(LAYOUT, 2), DictMedium()
    data = blocks(2, 8)
    pool.write([0, 1], data)
    engine = LocalEngine([pool, medium], {7: key(7), 8: key(8)}.__getitem__)
    engine.submit(TransferPlan(0, (7, 8), 0, np.array([0, 1]), 1, np.array([0, 1])))
    assert engine.wait(0).ok
    assert torch.equal(medium.blocks[key(8)], data[1])
    engine.discard(1, [7], [0])
    assert list(medium.blocks) == [key(8)]


def test_a_partly_landed_nvme_write_is_rolled_back(tmp_path):
    """One chunk of a 4-block write-back fails: the plan fails whole, and the three chunks
    that did land are deleted, so no store entry outlives the manager's decision."""
    pool = dram_pool(LAYOUT, 4)
    data = blocks(4, 9)
    pool.write([0, 1, 2, 3], data)
    keys = {i: key(i) for i in range(4)}
    store = NVMeStore(tmp_path / "s", LAYOUT, 8)
    write_one, write_chunk, current = store._write_one, store._write_chunk, threading.local()

    def tagged(key_, *args):  # I/O thread: remember whose chunk is being written
        current.key = key_
        return write_one(key_, *args)

    def failing(*args):
        if current.key == key(2):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return write_chunk(*args)

    store._write_one, store._write_chunk = tagged, failing
    engine = LocalEngine([pool, store], keys.__getitem__)
    engine.submit(TransferPlan(0, (0, 1, 2, 3), 0, np.arange(4), 1, np.array([3, 4, 5, 6])))
    result = engine.wait(0)
    assert not result.ok and "write failed" in result.error
    assert not any(store.contains(k) for k in keys.values())
    store.flush()
    store.close()
    with NVMeStore(tmp_path / "s", LAYOUT) as reopened:
        assert len(reopened) == 0 and reopened.stats["failed_writes"] == 0


# -- reads never destroy what they read (issue 8, item 4) -------------------------------------
@pytest.mark.parametrize("order", ["all", "alternating"])
def test_get_of_stored_blocks_never_evicts_one_of_them(tmp_path, order):
    data = blocks(8, 11)
    with TieredKVStore(LAYOUT, tiers(hbm=2, dram=2, nvme=4), path=tmp_path / "nvme") as store:
        store.put([key(i) for i in range(8)], data)
        where = store.lookup([key(i) for i in range(8)])[1]
        assert None not in where
        wanted = list(range(8))
        if order == "alternating":  # NVMe, DRAM, NVMe, DRAM...
            nvme = [i for i in wanted if where[i] == "nvme"]
            dram = [i for i in wanted if where[i] != "nvme"]
            wanted = [x for pair in zip(nvme, dram) for x in pair] + nvme[len(dram):] + dram[len(nvme):]
        got = store.get([key(i) for i in wanted])
        for row, i in enumerate(wanted):
            assert torch.equal(got[row], data[i]), i
        assert store.lookup([key(i) for i in range(8)])[0] == 8  # all still stored
        assert store.stats()["tiers"][2]["lost"] == 0
        store.check_invariants()


def test_hand_made_keys_sharing_a_prefix_are_distinct_blocks(tmp_path):
    keys = [f"s0-l0-b{i}".encode().ljust(16, b"_") for i in range(8, 14)]
    data = blocks(len(keys), 12)
    with TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme") as store:
        assert store.put(keys, data) == len(keys)
        for i, k in enumerate(keys):
            assert torch.equal(store.get([k])[0], data[i])
        assert store.stats()["key_collisions"] == 0


# -- bad API input: one clear UserError, the store still usable (issue 8, item 10) -------------
BAD_KEYS = {
    "short key": [b"x" * 15],
    "bytearray": [bytearray(16)],
    "generator": (key(i) for i in range(2)),
    "one bytes object": key(0),
    "str": ["0123456789abcdef"],
}


@pytest.mark.parametrize("case", sorted(BAD_KEYS))
def test_bad_keys_are_user_errors_and_change_nothing(tmp_path, case):
    with TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme") as store:
        store.put([key(0)], blocks(1, 13))
        for call in (lambda k: store.put(k, blocks(1, 14)), store.lookup, store.get, store.prefetch, store.pin, store.release,
                     lambda k: store.access(k, blocks(1, 14))):
            keys = BAD_KEYS[case]
            with pytest.raises(UserError):
                call(keys)
        store.check_invariants()
        assert store.lookup([key(0)])[0] == 1 and len(store._map.keys) == 1


def test_release_without_pin_raises_and_changes_nothing(tmp_path):
    from tiercache.core.counts import CountError

    with TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme") as store:
        store.put([key(0), key(1)], blocks(2, 15))
        store.pin([key(0)])
        with pytest.raises(CountError):
            store.release([key(0), key(1)])
        assert store.manager.refs == {store._map.ids([key(0)], False)[0]: 1}
        store.release([key(0)])
        store.check_invariants()


def test_pin_release_and_wait_name_what_was_wrong(tmp_path):
    """Errors name the caller's key, not the manager's internal id, and a wrong handle is a
    TypeError saying what ``wait`` takes (it was an AttributeError from inside)."""
    from tiercache.core.counts import CountError

    with TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme") as store:
        store.put([key(0)], blocks(1, 16))
        with pytest.raises(KeyError, match=f"key {key(9).hex()} is not stored"):
            store.pin([key(9)])
        store.pin([key(0)])
        with pytest.raises(CountError, match=f"key {key(0).hex()} is released more often than it is pinned"):
            store.release([key(0), key(0)])
        with pytest.raises(TypeError, match="pending must be a Pending"):
            store.wait(5)
        store.release([key(0)])
        store.check_invariants()


@pytest.mark.parametrize("device", ["cuda", "cuda:7", "bogus", "meta", 3.5])
def test_bad_devices_are_user_errors(tmp_path, device):
    if torch.cuda.is_available() and device == "cuda":
        pytest.skip("CUDA is available here")
    with pytest.raises(UserError, match="device"):
        TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme", device=device)


def test_bad_construction_arguments_are_user_errors(tmp_path):
    (tmp_path / "file").write_text("x")
    cases = [
        dict(layout={"layers": 2}, tiers=tiers(), path=tmp_path / "a"),
        dict(layout=LAYOUT, tiers=[("hbm", 4)], path=tmp_path / "b"),
        dict(layout=LAYOUT, tiers=tiers(), path=tmp_path / "file" / "store"),
        dict(layout=LAYOUT, tiers=[TierConfig("hbm", 1), TierConfig("dram", 2**40)], path=None),
    ]
    for kwargs in cases:
        with pytest.raises(UserError):
            TieredKVStore(**kwargs)


def test_unreadable_store_directory_is_a_user_error(tmp_path, monkeypatch):
    """A store that cannot even be opened (a read-only mount, no permission): injected."""
    import tiercache.live.media as media

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(media, "NVMeStore", denied)
    with pytest.raises(UserError, match="cannot open the nvme tier"):
        TieredKVStore(LAYOUT, tiers(), path=tmp_path / "ro")


def test_calls_after_close_are_user_errors(tmp_path):
    store = TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme")
    store.put([key(0)], blocks(1, 16))
    store.close()
    for call in (lambda: store.pin([key(0)]), lambda: store.release([key(0)]), store.flush, store.stats,
                 lambda: store.get([key(0)]), lambda: store.prefetch([key(0)])):
        with pytest.raises(UserError, match="closed"):
            call()
    assert store.close() == 0  # idempotent


def test_a_second_process_cannot_open_the_same_store(tmp_path):
    """Two writers on one path lost blocks before (issue 8, item 3): the second is refused,
    with the holder's pid, and the first keeps every block."""
    import os
    import subprocess
    import sys

    path = tmp_path / "nvme"
    data = blocks(6, 17)
    script = (
        "import sys\n"
        "from store_helpers import LAYOUT, tiers\n"
        "from tiercache.errors import UserError\n"
        "from tiercache.live.store import TieredKVStore\n"
        "try:\n"
        f"    TieredKVStore(LAYOUT, tiers(), path={str(path)!r})\n"
        "except UserError as exc:\n"
        "    print(exc); sys.exit(3)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    with TieredKVStore(LAYOUT, tiers(), path=path) as store:
        store.put([key(i) for i in range(6)], data)
        store.flush()
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 3, done.stderr
        assert str(os.getpid()) in done.stdout
        for i in range(6):
            assert torch.equal(store.get([key(i)])[0], data[i])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr  # free again once closed


def test_get_on_a_full_disk_drops_nothing_and_serves_in_place(tmp_path, monkeypatch):
    """The promotion a get triggers needs a write-back to NVMe that fails (disk full): the
    victims stay where they are and the block is read where it is (issue 8, item 7)."""
    import tiercache.data.chunkio as chunkio

    data = blocks(8, 18)
    with TieredKVStore(LAYOUT, tiers(hbm=2, dram=2, nvme=8), path=tmp_path / "nvme") as store:
        store.put([key(i) for i in range(8)], data)
        before = store.lookup([key(i) for i in range(8)])[1]
        in_nvme = [i for i, where in enumerate(before) if where == "nvme"]

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(chunkio, "write_chunk_file", full)
        monkeypatch.setattr(chunkio, "overwrite_chunk_file", full)
        got = store.get([key(in_nvme[0])])
        assert torch.equal(got[0], data[in_nvme[0]])
        assert store.lookup([key(i) for i in range(8)])[0] == 8  # nothing dropped
        assert store.stats()["tiers"][1]["failed_transfers"] >= 1
        store.check_invariants()
        monkeypatch.undo()
        for i in range(8):
            assert torch.equal(store.get([key(i)])[0], data[i]), i
