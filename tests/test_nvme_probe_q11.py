"""Probe Q11: a full disk, and bad store paths.

1. A freed NVMe slot's chunk file kept its disk space for the rest of the session, so a store
   whose blocks were all deleted still refused every put on a full disk, and its journal could
   never compact there. The disk is simulated without root by ``SmallDisk``: a disk of a few
   pages that holds only the store's files, gives pages back when a file is removed or cut, and
   fails a write or a journal reservation that does not fit with ENOSPC.
2. A ``bytes`` store path, or one holding a NUL byte, gave a bare TypeError/ValueError.
"""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

from tiercache.config import KVLayout, TierConfig
from tiercache.data import nvme_index
from tiercache.data.nvme import NVMeStore
from tiercache.errors import UserError
from tiercache.live.store import TieredKVStore

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16", per_layer=True)
PAGE = 4096
MODES = pytest.mark.parametrize("in_place", [True, False], ids=["overwrite-in-place", "rename-only"])


def pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages."""
    return -(-nbytes // PAGE) * PAGE


class SmallDisk:
    """A disk of ``size`` bytes that holds only the files directly under ``root``.

    A file takes its size in whole pages, or the room reserved past its end
    (``nvme_index.reserve_space``), whichever is more. A write that would grow the files
    past ``size`` is cut short at the last page that fits (then ENOSPC), a reservation that
    does not fit fails with ENOSPC, and a removed or truncated file gives its pages back.
    """

    def __init__(self, monkeypatch, root, size: int) -> None:
        self.root, self.size = os.fspath(root), size
        self.reserved: dict[int, int] = {}  # inode -> end of the room reserved past its size
        real_pwrite, real_write, real_ftruncate = os.pwrite, os.write, os.ftruncate
        real_reserve = nvme_index.reserve_space

        def pwrite(fd, data, offset):
            return real_pwrite(fd, self._fit(fd, data, offset), offset)

        def write(fd, data):
            return real_write(fd, self._fit(fd, data, os.lseek(fd, 0, os.SEEK_CUR)))

        def reserve(fd, offset, length):
            if self._counted(fd):
                if self._growth(fd, offset + length) > self.free():
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                ino = os.fstat(fd).st_ino
                self.reserved[ino] = max(self.reserved.get(ino, 0), pages(offset + length))
            real_reserve(fd, offset, length)

        def ftruncate(fd, length):
            if self._counted(fd):
                ino = os.fstat(fd).st_ino
                self.reserved[ino] = min(self.reserved.get(ino, 0), pages(length))
            real_ftruncate(fd, length)

        monkeypatch.setattr(os, "pwrite", pwrite)
        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "ftruncate", ftruncate)
        monkeypatch.setattr(nvme_index, "reserve_space", reserve)

    def used(self) -> int:
        """Bytes the files under ``root`` take now."""
        total = 0
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    total += max(pages(st.st_size), self.reserved.get(st.st_ino, 0))
        return total

    def free(self) -> int:
        return self.size - self.used()

    def _counted(self, fd: int) -> bool:
        return os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) == self.root

    def _growth(self, fd: int, end: int) -> int:
        """Bytes a file must take from the disk to reach ``end``."""
        st = os.fstat(fd)
        return max(0, pages(end) - max(pages(st.st_size), self.reserved.get(st.st_ino, 0)))

    def _fit(self, fd: int, data, offset: int):
        """``data``, cut to the pages the disk has left (ENOSPC when not one byte fits)."""
        view = memoryview(data).cast("B")
        if not self._counted(fd) or self._growth(fd, offset + len(view)) <= self.free():
            return view
        st = os.fstat(fd)
        reach = max(pages(st.st_size), self.reserved.get(st.st_ino, 0)) + self.free() // PAGE * PAGE
        if reach <= offset:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return view[: reach - offset]


def block(i: int) -> torch.Tensor:
    """Block ``i``: random bits, distinct for every ``i``, as a batch of one."""
    g = torch.Generator().manual_seed(i)
    return torch.randint(-(2**15), 2**15, (1, *LAYOUT.block_shape), dtype=torch.int16, generator=g).view(torch.bfloat16)


def key(i: int) -> bytes:
    return b"k%06d" % i


def put_each(store: NVMeStore, ids) -> list[int]:
    """Puts the blocks ``ids`` one at a time; the ids whose put succeeded."""
    return [i for i in ids if store.put([key(i)], block(i))[0].ok]


def fill(store: NVMeStore, start: int = 0) -> list[int]:
    """Puts blocks ``start, start + 1, ...`` until the first put fails (the disk is full)."""
    stored, i = [], start
    while store.put([key(i)], block(i))[0].ok:
        stored.append(i)
        i += 1
    assert stored, "not one block fitted"
    return stored


def assert_holds(path, present: set[int], absent: set[int] = frozenset(), exact: bool = True) -> None:
    """Reopens the store at ``path``: it holds every block of ``present`` bit-identical, none of
    ``absent``, nothing else when ``exact``, and whatever else it holds is bit-identical too."""
    with NVMeStore(path, LAYOUT) as store:
        store.check_invariants()
        held = {int(k[1:]) for k, _ in store.items()}
        assert present <= held, f"acknowledged blocks lost: {sorted(present - held)}"
        assert not held & absent, f"deleted blocks came back: {sorted(held & absent)}"
        assert not exact or held == present, f"blocks never acknowledged: {sorted(held - present)}"
        out = torch.empty((1, *LAYOUT.block_shape), dtype=torch.bfloat16)
        for i in sorted(held):
            assert store.get([key(i)], out)[0], f"block {i} indexed but unreadable"
            assert torch.equal(out.view(torch.int16), block(i).view(torch.int16)), f"block {i} torn or stale"
        assert store.stats["corrupt_reads"] == 0


def open_small(path, monkeypatch, in_place: bool, chunks: int) -> tuple[NVMeStore, SmallDisk]:
    """A store of 64 slots on a disk with room for about ``chunks`` chunk files."""
    store = NVMeStore(path, LAYOUT, 64, io_threads=1, overwrite_in_place=in_place)
    disk = SmallDisk(monkeypatch, path, 0)
    disk.size = disk.used() + chunks * pages(store.chunk_bytes + 4) + 4 * PAGE  # and a little journal
    return store, disk


# ----- 1. a freed slot gives its disk space back ---------------------------------------------------


@MODES
def test_puts_succeed_again_after_every_block_of_a_full_disk_was_deleted(tmp_path, monkeypatch, in_place):
    """Before the fix, rename-only: 0 of 12 puts succeeded after deleting every block (the
    dead chunk files kept the disk full). In place they are overwritten (a guard)."""
    path = tmp_path / "s"
    store, disk = open_small(path, monkeypatch, in_place, chunks=12)
    old = fill(store)
    store.flush()
    assert store.delete([key(i) for i in old]) == len(old)
    store.flush()
    new = list(range(1000, 1000 + len(old)))
    stored = put_each(store, new)
    assert stored == new, f"{len(stored)} of {len(new)} puts succeeded, failed_writes={store.stats['failed_writes']}"
    store.flush()
    assert len(store) == len(new) and store.free_blocks == 64 - len(new)
    store.check_invariants()
    shutil.copytree(path, tmp_path / "crashed")  # the disk at a crash right after that flush
    store.close()
    monkeypatch.undo()
    assert_holds(tmp_path / "crashed", set(new), set(old))
    assert_holds(path, set(new), set(old))


@MODES
def test_a_steady_delete_flush_put_cycle_on_a_full_disk_keeps_its_blocks(tmp_path, monkeypatch, in_place):
    """The probe's cycle: before the fix the journal grew into the disk's last pages and never
    compacted (in place), or the dead chunk files held them (rename-only), and the store fell
    from 12 blocks to 0 (in place 94 of 300 puts failed, rename-only all 300). Now a put
    fails only when the journal has taken the disk's last pages (here in round 68 of 100:
    1 put in place, 2 rename-only), and the next flush compacts it."""
    path = tmp_path / "s"
    store, _ = open_small(path, monkeypatch, in_place, chunks=12)
    live = fill(store)
    store.flush()
    failed, nxt = 0, 1000
    for _ in range(100):
        gone, live = live[:3], live[3:]
        store.delete([key(i) for i in gone])
        store.flush()
        ok = put_each(store, range(nxt, nxt + 3))
        failed += 3 - len(ok)
        live += ok
        nxt += 3
    store.flush()
    assert failed <= 2 and len(store) == len(live) >= 10, (failed, len(store))
    shutil.copytree(path, tmp_path / "crashed")
    store.close()
    monkeypatch.undo()
    assert_holds(tmp_path / "crashed", set(live))


@MODES
def test_deleting_one_block_of_a_full_disk_makes_room_for_the_next_put(tmp_path, monkeypatch, in_place):
    """One block deleted and flushed, one put, 40 times: the put takes the slot freed a moment
    ago, and rename-only its new chunk file needs the space of that slot's own old file,
    which it reclaims (before the fix the first put failed in both modes: rename-only for that
    space, in place for the journal's next page, the journal never being compacted)."""
    path = tmp_path / "s"
    store, _ = open_small(path, monkeypatch, in_place, chunks=12)
    live = fill(store)
    store.flush()
    for i in range(1000, 1040):
        store.delete([key(live.pop(0))])
        store.flush()
        assert store.put([key(i)], block(i))[0].ok, f"put {i - 999} of 40 failed"
        live.append(i)
    store.flush()
    assert store.stats["chunks_reclaimed"] == (0 if in_place else 40)
    shutil.copytree(path, tmp_path / "crashed")
    store.close()
    monkeypatch.undo()
    assert_holds(tmp_path / "crashed", set(live))


def test_a_full_disk_compacts_the_journal_once_deleted_blocks_free_space(tmp_path, monkeypatch):
    """In place, with a journal that wants compacting (past its threshold, here 0 bytes): the
    snapshot that would replace it did not fit while the deleted blocks' dead chunk files
    held the disk, so every flush appended instead and the journal only ever grew (before
    the fix it was still 808 bytes long after the deletes were flushed twice)."""
    monkeypatch.setattr(nvme_index, "_JOURNAL_MIN_BYTES", 0)
    path = tmp_path / "s"
    store, _ = open_small(path, monkeypatch, True, chunks=12)
    old = fill(store)
    store.flush()
    keep, gone = old[:2], old[2:]
    store.delete([key(i) for i in gone])
    store.flush()
    store.flush()
    files = store._files
    assert files.journal_bytes == 0 and not files.wants_snapshot(), (files.journal_bytes, files.snapshot_bytes)
    assert os.path.getsize(files.journal_path) == 0
    assert put_each(store, range(1000, 1000 + len(gone))) == list(range(1000, 1000 + len(gone)))
    store.close()
    monkeypatch.undo()
    assert_holds(path, set(keep) | set(range(1000, 1000 + len(gone))), set(gone))


class Crashed(BaseException):
    """Stands for SIGKILL right after the first dead chunk file was removed."""


def crash_after_first_chunk_removal(monkeypatch, path, image) -> None:
    """Copies the store directory (the disk at a crash) right after the first chunk file
    ``os.unlink`` removes from it, then raises ``Crashed``."""
    real_unlink = os.unlink

    def in_store(name, dir_fd=None) -> bool:  # by path, or by name in the folder the store holds open
        if dir_fd is not None:
            return os.path.samestat(os.fstat(dir_fd), os.stat(path))
        return os.path.dirname(os.fspath(name)) == os.fspath(path)

    def unlink(name, *args, **kwargs):
        real_unlink(name, *args, **kwargs)
        if in_store(name, kwargs.get("dir_fd")) and os.path.basename(name).startswith("c."):
            monkeypatch.setattr(os, "unlink", real_unlink)
            shutil.copytree(path, image)
            raise Crashed()

    monkeypatch.setattr(os, "unlink", unlink)


@MODES
def test_a_crash_while_dead_chunks_are_removed_keeps_every_acknowledged_block(tmp_path, monkeypatch, in_place):
    """Dead chunk files are removed only from free slots, whose release is durable: a crash
    right after the first removal reopens with every flushed block intact, every flushed
    deletion gone, and the unflushed put absent or intact."""
    path = tmp_path / "s"
    store, _ = open_small(path, monkeypatch, in_place, chunks=12)
    old = fill(store)
    store.flush()
    keep, gone = old[:4], old[4:]
    store.delete([key(i) for i in gone])
    store.flush()
    crash_after_first_chunk_removal(monkeypatch, path, tmp_path / "crashed")
    with pytest.raises(Crashed):  # slot 63 has no chunk file yet: its new one finds the disk full
        store.put([key(1000)], block(1000), slots=[63])
    store.close()
    monkeypatch.undo()
    assert_holds(tmp_path / "crashed", set(keep), set(gone), exact=False)


def test_a_dead_chunk_file_that_cannot_be_removed_fails_only_the_put(tmp_path, monkeypatch):
    """Rename-only, full disk: a reclaim whose removals fail (EIO) frees nothing, so the put
    fails with the disk's ENOSPC and the store stays as it was; the files stay marked, and the
    next put removes them (its own slot's and the other freed slot's) and succeeds."""
    path = tmp_path / "s"
    store, _ = open_small(path, monkeypatch, False, chunks=12)
    live = fill(store)
    store.flush()
    store.delete([key(i) for i in live[:2]])
    store.flush()
    real_unlink = os.unlink

    def failing_unlink(name, *args, **kwargs):
        if os.path.basename(os.fspath(name)).startswith("c."):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_unlink(name, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", failing_unlink)
    result = store.put([key(1000)], block(1000))[0]
    assert not result.ok and result.error.errno == errno.ENOSPC and store.stats["chunks_reclaimed"] == 0
    store.check_invariants()
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert store.put([key(1001)], block(1001))[0].ok and store.stats["chunks_reclaimed"] == 2
    store.close()
    monkeypatch.undo()
    assert_holds(path, set(live[2:]) | {1001}, set(live[:2]) | {1000})


# ----- 2. a bytes path, or one holding a NUL byte -----------------------------------------------------

BAD_PATHS = pytest.mark.parametrize("bad", ["bytes", "nul"])


def bad_path(tmp_path, bad: str):
    return os.fsencode(tmp_path / "store") if bad == "bytes" else os.fspath(tmp_path / "st\0ore")


@BAD_PATHS
def test_nvme_store_refuses_a_bytes_or_nul_path_naming_it(tmp_path, bad):
    path = bad_path(tmp_path, bad)
    with pytest.raises(UserError) as raised:
        NVMeStore(path, LAYOUT, 8)
    message = str(raised.value)
    assert message.startswith("NVMeStore: path ") and repr(path) in message
    assert ("must be a str" in message) if bad == "bytes" else ("NUL byte" in message)
    assert os.listdir(tmp_path) == []


@BAD_PATHS
def test_tiered_store_refuses_a_bytes_or_nul_path_naming_it(tmp_path, bad):
    path = bad_path(tmp_path, bad)
    tiers = [TierConfig("hbm", 2), TierConfig("dram", 2), TierConfig("nvme", 8)]
    with pytest.raises(UserError) as raised:
        TieredKVStore(LAYOUT, tiers, path=path, device="cpu")
    message = str(raised.value)
    assert message.startswith("TieredKVStore: path ") and repr(path) in message
    assert ("must be a str" in message) if bad == "bytes" else ("NUL byte" in message)
    assert os.listdir(tmp_path) == []


def test_a_path_of_another_type_is_refused_naming_its_type(tmp_path):
    with pytest.raises(UserError, match=r"NVMeStore: path must be a str or os\.PathLike of a str, got int 5"):
        NVMeStore(5, LAYOUT, 8)
