"""``TieredKVStore.close(persist=True)`` on a full disk: an incomplete persist is an error.

The store under test holds 12 blocks: 7 on NVMe (flushed before the fault), 5 only in HBM
and DRAM, which ``close`` tries to persist into free NVMe slots (DRAM's 3 first, then HBM's
2, one move each). Faults are ENOSPC on ``os.pwrite`` (every write of the disk) or on a
chunk write alone (so the index journal still appends and what landed is durable).
"""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from store_helpers import LAYOUT, blocks, key, tiers
from test_nvme_faults import fail_next
from tiercache.data import chunkio
from tiercache.live.store import PersistError, TieredKVStore

N = 12


def filled_store(path) -> tuple[TieredKVStore, torch.Tensor, list[int], list[int]]:
    """A store holding ``N`` blocks, its NVMe part flushed; (store, data, on NVMe, volatile)."""
    data = blocks(N, 42)
    store = TieredKVStore(LAYOUT, tiers(), path=path)
    store.put([key(i) for i in range(N)], data)
    store.flush()
    where = store.lookup([key(i) for i in range(N)])[1]
    on_nvme = [i for i, tier in enumerate(where) if tier == "nvme"]
    volatile = [i for i, tier in enumerate(where) if tier in ("hbm", "dram")]
    assert (len(on_nvme), len(volatile)) == (7, 5)
    return store, data, on_nvme, volatile


def reopened_holds(path, data: torch.Tensor) -> list[int]:
    """The blocks a reopened store holds, each checked bit for bit against ``data``."""
    with TieredKVStore(LAYOUT, tiers(), path=path) as again:
        again.check_invariants()
        held = [i for i, tier in enumerate(again.lookup([key(i) for i in range(N)])[1]) if tier is not None]
        for i in held:
            assert torch.equal(again.get([key(i)])[0], data[i]), f"block {i} reopened with other bytes"
        return held


def chunk_writes_fail_after(monkeypatch, landed: int) -> None:
    """The disk fills up after ``landed`` more chunk writes: every later chunk write raises
    ENOSPC (thread-safe: the NVMe tier writes on several I/O threads). The index journal
    still appends, so a flush makes what landed durable."""
    real, lock, left = chunkio.write_chunk_file, threading.Lock(), [landed]

    def fake(*args, **kwargs):
        with lock:
            ok = left[0] > 0
            left[0] -= ok
        if not ok:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    monkeypatch.setattr(chunkio, "write_chunk_file", fake)


def test_a_persist_whose_every_write_fails_raises_naming_the_count_and_the_os_error(tmp_path, monkeypatch):
    path = tmp_path / "nvme"
    store, data, on_nvme, volatile = filled_store(path)
    fail_next(monkeypatch, "pwrite", count=10**6)  # the disk is full: every write fails
    with pytest.raises(PersistError) as caught:
        store.close()
    monkeypatch.undo()
    error = caught.value
    assert isinstance(error, OSError)
    assert (error.saved, error.failed) == (0, 5)
    assert "5 of 5 blocks" in str(error) and os.strerror(errno.ENOSPC) in str(error)
    assert store.close() == 0  # closed: the media were closed despite the error, idempotent
    assert reopened_holds(path, data) == on_nvme


def test_a_persist_that_fails_after_some_moves_counts_exactly_what_was_saved(tmp_path, monkeypatch):
    path = tmp_path / "nvme"
    store, data, on_nvme, volatile = filled_store(path)
    chunk_writes_fail_after(monkeypatch, landed=3)  # DRAM's 3 blocks land, HBM's 2 do not
    with pytest.raises(PersistError) as caught:
        store.close()
    monkeypatch.undo()
    assert (caught.value.saved, caught.value.failed) == (3, 2)
    assert "2 of 5 blocks" in str(caught.value) and "3 were saved" in str(caught.value)
    held = reopened_holds(path, data)
    assert len(held) == len(on_nvme) + caught.value.saved and set(on_nvme) <= set(held)


def test_a_move_that_fails_midway_is_taken_back_whole_and_counted_as_failed(tmp_path, monkeypatch):
    """One of DRAM's 3 chunks lands before the disk fills: the move fails as a whole, so the
    landed chunk is taken back; none of the 5 blocks is saved, and none reopens."""
    path = tmp_path / "nvme"
    store, data, on_nvme, volatile = filled_store(path)
    chunk_writes_fail_after(monkeypatch, landed=1)
    with pytest.raises(PersistError) as caught:
        store.close()
    monkeypatch.undo()
    assert (caught.value.saved, caught.value.failed) == (0, 5)
    assert reopened_holds(path, data) == on_nvme


def test_a_failed_flush_after_a_partial_persist_is_the_error_raised(tmp_path, monkeypatch):
    """DRAM's 3 blocks are written, then the disk is full for the index journal too: the
    flush error is raised (those 3 are not durable, so a count of them as saved would lie)
    and the store reopens with what its last flush made durable."""
    path = tmp_path / "nvme"
    store, data, on_nvme, volatile = filled_store(path)
    chunk_writes_fail_after(monkeypatch, landed=3)
    error = close_with_every_flush_failing(store, monkeypatch)
    assert not isinstance(error, PersistError) and error.errno == errno.ENOSPC
    assert reopened_holds(path, data) == on_nvme


def close_with_every_flush_failing(store, monkeypatch) -> OSError:
    """Closes ``store`` with the disk full for every flush (the journal batch, and the
    snapshot written instead); returns the error ``close`` raised."""
    real_flush = type(store._media[2]).flush

    def full_disk_flush(medium):
        for name in ("pwrite", "write"):
            fail_next(monkeypatch, name, count=10**6)
        return real_flush(medium)

    monkeypatch.setattr(type(store._media[2]), "flush", full_disk_flush)
    with pytest.raises(OSError) as caught:
        store.close()
    monkeypatch.undo()
    return caught.value


def test_a_complete_persist_returns_its_count_and_persist_false_skips_it(tmp_path):
    path = tmp_path / "nvme"
    store, data, on_nvme, volatile = filled_store(path)
    assert store.close() == 5
    assert reopened_holds(path, data) == list(range(N))
    other = tmp_path / "other"
    store, data, on_nvme, volatile = filled_store(other)
    assert store.close(persist=False) == 0
    assert reopened_holds(other, data) == on_nvme
