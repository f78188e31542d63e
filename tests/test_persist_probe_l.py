"""Probe L on ``close(persist=True)``: a failed write costs one block, not a tier's batch
(F2); blocks that do not fit are counted (F3); a flush that fails once at close loses
nothing, one that fails for good names the store (F4); ``PersistError`` pickles (F5).

The 12-block store of ``test_close_persist_errors`` is reused: 7 blocks on NVMe, 5 only
in HBM and DRAM (DRAM's 3 persisted in one move, then HBM's 2)."""

from __future__ import annotations

import copy
import errno
import os
import pickle

import pytest

from store_helpers import LAYOUT, blocks, key, tiers
from test_close_persist_errors import N, chunk_writes_fail_after, close_with_every_flush_failing, filled_store, reopened_holds
from test_nvme_faults import fail_next
from tiercache.data import chunkio
from tiercache.live.lifecycle import Persisted, persist_to_nvme
from tiercache.live.store import PersistError, TieredKVStore


def writes_of_one_block_fail(monkeypatch, block) -> None:
    """Every chunk write of ``block``'s bytes raises EIO (a write that fails again when
    retried), on both write paths (new file and in-place overwrite); others pass."""
    bad = block.numpy().tobytes()
    for name in ("write_chunk_file", "overwrite_chunk_file"):
        real = getattr(chunkio, name)

        def fake(*args, real=real, payload_at=2 if name == "write_chunk_file" else 1, **kwargs):
            payload = args[payload_at]
            if payload.tobytes() == bad:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real(*args, **kwargs)

        monkeypatch.setattr(chunkio, name, fake)


def test_one_transient_write_error_during_the_persist_loses_no_block(tmp_path, monkeypatch):
    """F2: the first chunk write fails once; DRAM's move is taken back, its blocks are
    tried again one per move, and all 5 are saved."""
    path = tmp_path / "nvme"
    store, data, on_nvme, volatile = filled_store(path)
    fail_next(monkeypatch, "pwrite", count=1, code=errno.EIO)
    assert store.close() == 5
    monkeypatch.undo()
    assert store._media[2].stats["failed_writes"] == 1  # the fault did hit the persist
    assert reopened_holds(path, data) == list(range(N))


def test_a_block_whose_write_always_fails_is_the_only_one_lost(tmp_path, monkeypatch):
    """F2: one DRAM block cannot be written at all: it fails alone, its move's 2 others
    and HBM's 2 are saved."""
    path = tmp_path / "nvme"
    store, data, on_nvme, volatile = filled_store(path)
    lost = next(i for i in volatile if store.lookup([key(i)])[1] == ["dram"])
    writes_of_one_block_fail(monkeypatch, data[lost])
    with pytest.raises(PersistError) as caught:
        store.close()
    monkeypatch.undo()
    error = caught.value
    assert (error.saved, error.failed, error.left_out) == (4, 1, 0)
    assert "1 of 5 blocks" in str(error) and "4 were saved" in str(error) and os.strerror(errno.EIO) in str(error)
    assert reopened_holds(path, data) == sorted(set(range(N)) - {lost})


def small_nvme_store(path) -> tuple[TieredKVStore, object]:
    """12 blocks over HBM 2, DRAM 3, NVMe 9: 5 held only in HBM/DRAM, 2 NVMe slots free."""
    data = blocks(N, 42)
    store = TieredKVStore(LAYOUT, tiers(2, 3, 9), path=path)
    store.put([key(i) for i in range(N)], data)
    store.flush()
    assert store.manager.dirs[2].n_free == 2
    return store, data


def small_store_reopens(path) -> int:
    """How many of the ``N`` blocks the store of ``small_nvme_store`` reopens with."""
    with TieredKVStore(LAYOUT, tiers(2, 3, 9), path=path) as again:
        again.check_invariants()
        return sum(tier is not None for tier in again.lookup([key(i) for i in range(N)])[1])


def test_blocks_that_do_not_fit_are_counted_and_named_in_the_message(tmp_path, monkeypatch):
    """F3: of 5 blocks, 2 fit; DRAM's 2 and then HBM's 2 are tried and fail (4), 1 never
    fits: the message counts against all 5."""
    path = tmp_path / "nvme"
    store, data = small_nvme_store(path)
    chunk_writes_fail_after(monkeypatch, landed=0)
    with pytest.raises(PersistError) as caught:
        store.close()
    monkeypatch.undo()
    error = caught.value
    assert (error.saved, error.failed, error.left_out) == (0, 4, 1)
    assert "4 of 5 blocks" in str(error) and "1 did not fit" in str(error) and "the 5 not saved" in str(error)
    assert small_store_reopens(path) == 7


def test_a_complete_persist_counts_the_blocks_left_out(tmp_path):
    """F3: no fault, 2 of 5 blocks fit: saved 2, left out 3, no error."""
    path = tmp_path / "nvme"
    store, data = small_nvme_store(path)
    assert persist_to_nvme(store.manager, store.events) == Persisted(saved=2, failed=0, left_out=3)
    assert store.close(persist=False) == 0
    assert small_store_reopens(path) == 9


def test_a_flush_that_fails_once_at_close_is_retried_and_everything_reopens(tmp_path, monkeypatch):
    """F4: the flush after the persist fails once (EIO on the index journal); closing the
    NVMe tier flushes again, so every block, the 5 persisted included, reopens."""
    path = tmp_path / "nvme"
    store, data, on_nvme, volatile = filled_store(path)
    medium = store._media[2]
    real_flush, calls = type(medium).flush, []

    def flaky_flush(self):
        calls.append(self)
        if len(calls) == 1:
            fail_next(monkeypatch, "pwrite", count=1, code=errno.EIO)
        return real_flush(self)

    monkeypatch.setattr(type(medium), "flush", flaky_flush)
    assert store.close() == 5
    monkeypatch.undo()
    assert medium.stats["failed_flushes"] == 1
    assert reopened_holds(path, data) == list(range(N))


def test_a_flush_that_fails_for_good_at_close_names_the_store_and_what_is_not_durable(tmp_path, monkeypatch):
    """F4: every flush at close fails: the error is the NVMe tier's, naming the store and
    saying what is not durable; the persisted blocks do not reopen."""
    path = tmp_path / "nvme"
    store, data, on_nvme, volatile = filled_store(path)
    error = close_with_every_flush_failing(store, monkeypatch)
    assert not isinstance(error, PersistError) and error.errno == errno.ENOSPC
    assert str(path) in str(error) and "not durable" in str(error)
    assert reopened_holds(path, data) == on_nvme


@pytest.mark.parametrize("clone", [lambda e: pickle.loads(pickle.dumps(e)), copy.copy, copy.deepcopy],
                         ids=["pickle", "copy", "deepcopy"])
def test_persist_error_round_trips_with_its_counts(clone):
    """F5: a PersistError from a worker process reaches the parent intact."""
    error = PersistError(3, 2, "[Errno 28] No space left on device", left_out=1)
    again = clone(error)
    assert type(again) is PersistError and str(again) == str(error)
    assert (again.saved, again.failed, again.left_out, again.reason) == (3, 2, 1, error.reason)
