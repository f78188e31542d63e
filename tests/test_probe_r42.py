"""Review R42 findings on the NVMe store's release:

- R42-1 (high): a close that timed out released the lock at once, so the same path reopened
  in this process while the old writes were still running; they wrote by slot number over the
  new store's flushed blocks (90 of 100 lost). The lock is now held until they finish.
- R42-2: an open failing after the lock was taken (out of file descriptors at the O_DIRECT
  probe) kept the path locked and leaked its descriptors until the process exited.
- R42-4: a write still queued after such a close failed with ctypes' ArgumentError (the
  journal it reserves room in was closed under it).
"""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch

from tiercache.data import chunkio
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
