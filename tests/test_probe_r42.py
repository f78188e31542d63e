"""Review R42 findings on the NVMe store's release:

- R42-1 (high): a close that timed out released the lock at once, so the same path reopened
  in this process while the old writes were still running; they wrote by slot number over the
  new store's flushed blocks (90 of 100 lost). The lock is now held until they finish.
- R42-2: an open failing after the lock was taken (out of file descriptors at the O_DIRECT
  probe) kept the path locked and leaked its descriptors until the process exited.
- R42-3: an open read its index and swept its folder by path between its two folder checks:
  another store's folder renamed onto the path meanwhile lost its unflushed chunks (swept as
  garbage) and its clean mark before the open was refused. The open now reads, sweeps and
  writes through the folder it locked.
- R42-4: a write still queued after such a close failed with ctypes' ArgumentError (the
  journal it reserves room in was closed under it).
"""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

from tiercache.data import chunkio, nvme_open
from tiercache.data.nvme import NVMeStore
from tiercache.errors import UserError

from store_helpers import LAYOUT, blocks, key


def _slow_writes(monkeypatch, seconds: float) -> None:
    real = chunkio.write_chunk_file

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(chunkio, "write_chunk_file", slow)


def _open_when_released(path, timeout: float = 10.0, **kwargs) -> NVMeStore:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return NVMeStore(path, LAYOUT, **kwargs)
        except UserError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_path_whose_close_timed_out_stays_locked_until_its_writes_end(tmp_path, monkeypatch):
    path = tmp_path / "s"
    first = NVMeStore(path, LAYOUT, capacity_blocks=128, overwrite_in_place=False, io_threads=2)
    _slow_writes(monkeypatch, 0.02)
    pending = first.submit_put([key(1000 + i) for i in range(60)], blocks(60, 1))
    first.close_timeout_s = 0.05
    with pytest.raises(OSError, match="stays locked until they have finished"):
        first.close()
    with pytest.raises(UserError, match="store in use"):  # the late writes still own the slots
        NVMeStore(path, LAYOUT)
    results = pending.result(timeout=30)
    assert all(r.ok or isinstance(r.error, OSError) for r in results)  # R42-4: never ctypes' ArgumentError
    monkeypatch.undo()
    second = _open_when_released(path)
    data = blocks(100, 2)
    assert all(r.ok for r in second.put([key(i) for i in range(100)], data))
    second.flush()
    out = torch.empty_like(data)
    assert all(second.get([key(i) for i in range(100)], out)) and torch.equal(out, data)
    second.close()
    with NVMeStore(path, LAYOUT) as third:  # the second's blocks, and those of the first its final flush made durable
        assert all(third.get([key(i) for i in range(100)], out)) and torch.equal(out, data)
        assert 100 <= len(third) <= 160 and third.stats["corrupt_reads"] == 0


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_an_open_failing_after_the_lock_releases_it_and_its_descriptors(tmp_path, monkeypatch):
    path = tmp_path / "s"
    NVMeStore(path, LAYOUT, capacity_blocks=8).close()
    before = _open_fds()

    def no_descriptors(*args, **kwargs):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(chunkio, "supports_direct", no_descriptors)
    with pytest.raises(OSError, match="Too many open files"):
        NVMeStore(path, LAYOUT)
    monkeypatch.undo()
    assert _open_fds() == before
    with NVMeStore(path, LAYOUT) as store:  # not left locked
        assert store.capacity == 8


def _files(path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


@pytest.mark.parametrize("clean", [True, False])
def test_an_open_racing_a_folder_swap_never_touches_the_folder_swapped_in(tmp_path, monkeypatch, clean):
    path, archived, other = tmp_path / "s", tmp_path / "archived", tmp_path / "other"
    first = NVMeStore(path, LAYOUT, capacity_blocks=16)
    first.put([key(i) for i in range(4)], blocks(4, 3))
    if clean:
        first.close()
    else:
        first.flush()
        with pytest.warns(ResourceWarning):
            first.__del__()  # dropped unclosed: no clean mark, every trailer checked at the next open
    second = NVMeStore(other, LAYOUT, capacity_blocks=16)
    second.put([key(10 + i) for i in range(6)], blocks(6, 4))
    second.flush()
    data = blocks(5, 5)
    assert all(r.ok for r in second.put([key(20 + i) for i in range(5)], data))  # chunks, not yet indexed
    real, swapped = nvme_open._check_locked_folder, []

    def check_then_swap(root, lock):
        real(root, lock)
        if not swapped:
            swapped.append(True)
            os.rename(path, archived)
            os.rename(other, path)

    monkeypatch.setattr(nvme_open, "_check_locked_folder", check_then_swap)
    before = _files(other)
    with pytest.raises(UserError, match="the store's folder was replaced while it opened; open it again"):
        NVMeStore(path, LAYOUT)
    assert _files(path) == before  # the swapped-in folder: no chunk swept, no index or mark written
    os.rename(path, other)  # back where the second store checks it is
    second.flush()
    out = torch.empty_like(data)
    assert all(second.get([key(20 + i) for i in range(5)], out)) and torch.equal(out, data)
    second.close()
    monkeypatch.undo()
    with NVMeStore(archived, LAYOUT) as reopened:
        assert len(reopened) == 4 and reopened.stats["recovered_dropped"] == 0


def test_a_creation_racing_a_folder_swap_creates_in_the_folder_it_locked(tmp_path, monkeypatch):
    path, archived, other = tmp_path / "s", tmp_path / "archived", tmp_path / "other"
    with NVMeStore(other, LAYOUT, capacity_blocks=16) as second:
        second.put([key(i) for i in range(3)], blocks(3, 6))
    real = nvme_open._check_locked_folder

    def check_then_swap(root, lock):
        real(root, lock)
        if not archived.exists():
            os.rename(path, archived)
            os.rename(other, path)

    monkeypatch.setattr(nvme_open, "_check_locked_folder", check_then_swap)
    before = _files(other)
    with pytest.raises(UserError, match="the store's folder was replaced while it opened; open it again"):
        NVMeStore(path, LAYOUT, capacity_blocks=8)
    assert _files(path) == before  # the other store's zarr.json, index and chunks as they were
    monkeypatch.undo()
    with NVMeStore(path, LAYOUT) as reopened:
        assert len(reopened) == 3
    with NVMeStore(archived, LAYOUT) as created:  # the creation finished where it was locked
        assert len(created) == 0 and created.capacity == 8
