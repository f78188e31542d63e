"""Opening an NVMe store after an interrupted creation, a damaged journal tail, or a fork.

probeA findings: a kill during creation left ``zarr.json`` without an index, and the path
never opened again; damage to the journal's last batch after a clean close lost blocks
with every counter at 0; a forked child kept the store's lock after the parent closed it,
and the refusal blamed "this process".
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tiercache.config import KVLayout
from tiercache.data import nvme_index, nvme_open
from tiercache.data.nvme import NVMeStore
from tiercache.data.nvme_index import IndexFiles
from tiercache.data.nvme_journal import HEADER
from tiercache.data.nvme_lock import LOCK_NAME, StoreLock
from tiercache.data.nvme_open import CLEAN_NAME
from tiercache.errors import UserError

LAYOUT = KVLayout(layers=1, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
OTHER = KVLayout(layers=1, kv_heads=2, head_dim=32, block_tokens=16, dtype="float16")


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, *LAYOUT.block_shape), generator=gen).to(torch.float16)


def keys(n: int) -> list[bytes]:
    return [b"key%02d" % i for i in range(n)]


class Killed(Exception):
    """Stands for a SIGKILL at the point where it is raised."""


def interrupted_creation(path, monkeypatch, layout: KVLayout = LAYOUT) -> None:
    """Leaves what a creation killed after ``zarr.json`` and before its index leaves."""
    def killed(self):
        (path / nvme_index.SNAPSHOT_TMP_NAME).write_bytes(b"TCS1 half")
        raise Killed()

    with monkeypatch.context() as patch:
        patch.setattr(IndexFiles, "create", killed)
        with pytest.raises(Killed):
            NVMeStore(path, layout, 8)
    assert sorted(os.listdir(path)) == sorted([LOCK_NAME, "zarr.json", nvme_index.SNAPSHOT_TMP_NAME])


def assert_usable(store: NVMeStore, capacity: int) -> None:
    data = blocks(2)
    assert len(store) == 0 and store.capacity == capacity
    store.put(keys(2), data)
    store.flush()
    out = torch.empty_like(data)
    assert store.get(keys(2), out).all() and torch.equal(out, data)


def test_a_creation_killed_before_its_index_is_finished_or_created_again(tmp_path, monkeypatch):
    interrupted_creation(tmp_path / "again", monkeypatch)
    with NVMeStore(tmp_path / "again", LAYOUT, 12) as store:  # with a capacity: created anew
        assert_usable(store, 12)
    with NVMeStore(tmp_path / "again", LAYOUT) as store:  # and it is a store like any other
        assert len(store) == 2
    interrupted_creation(tmp_path / "finish", monkeypatch)
    with NVMeStore(tmp_path / "finish", LAYOUT) as store:  # a reopen finishes it (the live store's path)
        assert_usable(store, 8)
    (tmp_path / "partial").mkdir()  # killed while zarr wrote zarr.json (its temp file, no zarr.json)
    (tmp_path / "partial" / "zarr.0123456789abcdef0123456789abcdef.partial").write_bytes(b'{"zarr_f')
    (tmp_path / "partial" / LOCK_NAME).write_bytes(b"12\n")
    with NVMeStore(tmp_path / "partial", LAYOUT, 8) as store:
        assert_usable(store, 8)
    assert not [name for name in os.listdir(tmp_path / "partial") if name.endswith(".partial")]


def test_an_unfinished_creation_is_never_taken_for_a_store_nor_confused_with_data(tmp_path, monkeypatch):
    path = tmp_path / "s"
    interrupted_creation(path, monkeypatch)
    before = sorted(os.listdir(path))
    with pytest.raises(UserError, match="no store there"):
        NVMeStore(path, LAYOUT, create=False)
    with pytest.raises(UserError, match="creation was interrupted.*store holds layout.*pass capacity_blocks"):
        NVMeStore(path, OTHER)
    assert sorted(os.listdir(path)) == before, "a refused open changed the directory"
    with NVMeStore(path, OTHER, 4) as store:  # the caller's own arguments create it anew
        assert store.capacity == 4
    for name in (nvme_index.SNAPSHOT_NAME, nvme_index.JOURNAL_NAME, CLEAN_NAME):
        (path / name).unlink()  # a store whose index is gone: only zarr.json and the lock are left
    for extra in (nvme_index.JOURNAL_NAME, "c.0.0.0.0.0", "notes.txt"):  # maybe a real store's data
        (path / extra).write_bytes(b"x")
        with pytest.raises(UserError, match="index snapshot missing"):
            NVMeStore(path, OTHER, 4)
        assert (path / extra).read_bytes() == b"x"
        (path / extra).unlink()


def store_with_batches(path, batches: int = 3, per_batch: int = 5) -> list[int]:
    """A cleanly closed store whose journal holds ``batches`` batches; their offsets."""
    data = blocks(batches * per_batch)
    offsets = []
    with NVMeStore(path, LAYOUT, 40) as store:
        for first in range(0, batches * per_batch, per_batch):
            offsets.append(os.path.getsize(path / nvme_index.JOURNAL_NAME))
            store.put(keys(batches * per_batch)[first : first + per_batch], data[first : first + per_batch])
            store.flush()
    return offsets


def damage_journal(path, change) -> None:
    journal = path / nvme_index.JOURNAL_NAME
    data = bytearray(journal.read_bytes())
    journal.write_bytes(bytes(change(data)))


def flip_two_bits_at(offset: int):
    def change(data):
        data[offset + HEADER.size + 3] ^= 0x11
        return data
    return change


@pytest.mark.parametrize("damage", ["two-bits", "cut"])
def test_damage_to_the_last_batch_after_a_clean_close_is_counted(tmp_path, damage):
    path = tmp_path / "s"
    last = store_with_batches(path)[-1]
    damage_journal(path, flip_two_bits_at(last) if damage == "two-bits" else lambda data: data[: last + 10])
    with NVMeStore(path, LAYOUT) as store:
        assert len(store) == 10
        assert store.stats["journal_skipped"] == 1, "an acknowledged batch was lost without a count"
    with NVMeStore(path, LAYOUT) as store:  # the loss was made durable, and is not counted twice
        assert len(store) == 10 and store.stats["journal_skipped"] == 0
        assert_more_batches_reopen(store, path)


def assert_more_batches_reopen(store: NVMeStore, path) -> None:
    data = blocks(1, seed=9)
    store.put([b"after"], data)
    store.flush()
    store.close()
    with NVMeStore(path, LAYOUT) as again:
        out = torch.empty_like(data)
        assert len(again) == 11 and again.get([b"after"], out).all() and torch.equal(out, data)


def test_a_torn_tail_after_a_crash_and_a_damaged_marker_count_nothing(tmp_path):
    path = tmp_path / "s"
    last = store_with_batches(path)[-1]
    (path / CLEAN_NAME).unlink()  # as after a kill: no clean-shutdown marker
    damage_journal(path, lambda data: data[: last + 10])
    with NVMeStore(path, LAYOUT) as store:
        assert len(store) == 10 and store.stats["journal_skipped"] == 0
    marker = path / CLEAN_NAME
    good = marker.read_bytes()
    for bad in (bytes([good[0] ^ 0x08]) + good[1:], b"999\n", good[:-3]):  # another seq, old format, cut
        marker.write_bytes(bad)
        with NVMeStore(path, LAYOUT) as store:
            assert len(store) == 10 and store.stats["journal_skipped"] == 0


def test_the_clean_marker_still_skips_the_trailer_checks(tmp_path, monkeypatch):
    store_with_batches(tmp_path / "s")
    verified, real = [], nvme_open.sweep_directory

    def sweep(*args, verify, **kwargs):
        verified.append(verify)
        return real(*args, verify=verify, **kwargs)

    monkeypatch.setattr(nvme_open, "sweep_directory", sweep)
    NVMeStore(tmp_path / "s", LAYOUT).close()
    with pytest.warns(ResourceWarning):
        NVMeStore(tmp_path / "s", LAYOUT).__del__()  # dropped unclosed: an unclean shutdown
    NVMeStore(tmp_path / "s", LAYOUT).close()
    assert verified == [False, False, True]


def test_a_forked_child_does_not_keep_the_parents_lock(tmp_path):
    path = tmp_path / "s"
    store = NVMeStore(path, LAYOUT, 8)
    store.put([b"a"], blocks(1))
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never touches the store; it just lives on
        try:
            os.write(ready_w, b"1" if not store._dir_lock.held else b"0")
            os.read(done_r, 1)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"1", "the child still holds the store's lock"
        store.close()
        with NVMeStore(path, LAYOUT) as reopened:
            assert reopened.contains(b"a")
    finally:
        os.write(done_w, b"x")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, done_r, done_w):
            os.close(fd)


def test_a_lock_inherited_outside_fork_is_not_blamed_on_this_process(tmp_path):
    path = tmp_path / "s"
    NVMeStore(path, LAYOUT, 8).close()
    lock = StoreLock.acquire(str(path))
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                             pass_fds=[lock._fd])  # fork+exec keeps the locked descriptor open
    try:
        lock.release()
        with pytest.raises(UserError, match=f"a process forked from this one \\(pid {os.getpid()}\\)") as err:
            NVMeStore(path, LAYOUT)
        assert "this process:" not in str(err.value)
    finally:
        child.communicate(b"")
    with NVMeStore(path, LAYOUT) as store:
        with pytest.raises(UserError, match=f"pid {os.getpid()} \\(this process: another open store"):
            NVMeStore(path, LAYOUT)
        assert store.capacity == 8
