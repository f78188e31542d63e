"""A full disk never costs complete NVMe blocks their index entries (probe U, finding 1).

The disk is simulated without root: ``FullDisk`` gives the store's directory a byte budget;
a write that grows a file past its allocated size takes the growth from the budget and is
cut short (then ENOSPC) when it runs out, as on a real filesystem, and a journal
reservation (``nvme_index.reserve_space``) takes its bytes from the same budget.
"""

from __future__ import annotations

import errno
import os

import torch

from tiercache.config import KVLayout
from tiercache.data import nvme_index
from tiercache.data.nvme import NVMeStore
from tiercache.data.nvme_index import record_cost

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16", per_layer=True)


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, (n, *LAYOUT.block_shape), dtype=torch.int16, generator=g).view(torch.bfloat16)


def keys(n: int) -> list[bytes]:
    return [b"key-%04d" % i for i in range(n)]


class FullDisk:
    """``free`` bytes left for the files under ``root`` (other files are not counted)."""

    def __init__(self, monkeypatch, root, free: int) -> None:
        self.root, self.free = os.fspath(root), free
        real_pwrite, real_write = os.pwrite, os.write
        real_reserve = getattr(nvme_index, "reserve_space", None)  # absent before the fix

        def pwrite(fd, data, offset):
            return real_pwrite(fd, self._fit(fd, data, offset), offset)

        def write(fd, data):
            return real_write(fd, self._fit(fd, data, os.lseek(fd, 0, os.SEEK_CUR)))

        def reserve(fd, offset, length):
            if self._counted(fd):
                self._take(fd, offset + length, cut=False)
            real_reserve(fd, offset, length)

        monkeypatch.setattr(os, "pwrite", pwrite)
        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(nvme_index, "reserve_space", reserve, raising=False)

    def _counted(self, fd: int) -> bool:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(self.root)

    def _fit(self, fd: int, data, offset: int):
        """``data``, cut to what the budget allows (ENOSPC when nothing fits)."""
        view = memoryview(data).cast("B")
        if not self._counted(fd):
            return view
        end = self._take(fd, offset + len(view), cut=True)
        return view[: end - offset]

    def _take(self, fd: int, end: int, cut: bool) -> int:
        """Takes the file's growth up to ``end`` past what it has allocated (its size, or
        its blocks: space reserved past its end) from the budget; returns how far the
        write reaches (``cut``: as far as the budget allows, else all or ENOSPC)."""
        st = os.fstat(fd)
        have = max(st.st_size, st.st_blocks * 512)
        if end - have <= self.free:
            reach = end
        elif cut and self.free > 0:
            reach = have + self.free
        else:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.free -= max(0, reach - have)
        return reach


def fill(store: NVMeStore, data: torch.Tensor, first: int = 0) -> list[bytes]:
    """Puts ``data[first:]`` one block at a time (as ``keys(len(data))``) until the disk is
    full; the keys whose put succeeded."""
    stored = []
    for key, block in list(zip(keys(len(data)), data))[first:]:
        if store.put([key], block[None])[0].ok:
            stored.append(key)
    return stored


def assert_reopens_with(path, stored: list[bytes], data: torch.Tensor) -> None:
    index = {key: i for i, key in enumerate(keys(len(data)))}
    with NVMeStore(path, LAYOUT) as reopened:
        assert sorted(k for k, _ in reopened.items()) == sorted(stored)
        out = torch.empty(len(stored), *LAYOUT.block_shape, dtype=torch.bfloat16)
        assert reopened.get(stored, out).all()
        assert torch.equal(out.view(torch.int16), data[[index[k] for k in stored]].view(torch.int16))
        reopened.check_invariants()


def test_full_disk_without_an_earlier_flush_keeps_every_complete_block(tmp_path, monkeypatch):
    data = blocks(10)
    store = NVMeStore(tmp_path / "s", LAYOUT, 16, io_threads=1)
    FullDisk(monkeypatch, tmp_path / "s", free=int(4.5 * (store.chunk_bytes + 4)))
    stored = fill(store, data)
    assert 0 < len(stored) < len(data) and store.stats["failed_writes"] == len(data) - len(stored)
    store.close()  # before the fix: ENOSPC, the chunks took the space the journal needed
    monkeypatch.undo()
    assert_reopens_with(tmp_path / "s", stored, data)


def test_full_disk_when_the_index_wants_a_snapshot_appends_to_the_journal(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme_index, "_JOURNAL_MIN_BYTES", 0)  # any journal longer than the snapshot compacts
    data = blocks(10, seed=1)
    store = NVMeStore(tmp_path / "s", LAYOUT, 16, io_threads=1)
    assert all(r.ok for r in store.put(keys(2), data[:2]))
    store.flush()
    FullDisk(monkeypatch, tmp_path / "s", free=int(3.5 * (store.chunk_bytes + 4)))
    stored = keys(2) + fill(store, data, first=2)
    assert 2 < len(stored) < len(data)
    assert store._files.wants_snapshot()
    store.close()  # the snapshot does not fit: its batch goes to the journal's reserved room
    monkeypatch.undo()
    assert_reopens_with(tmp_path / "s", stored, data)


def failing_pwrite(*args) -> int:
    raise OSError(errno.EIO, "I/O error")


def test_journal_room_promised_matches_the_records_still_to_come(tmp_path, monkeypatch):
    data = blocks(4, seed=2)
    with NVMeStore(tmp_path / "s", LAYOUT, 8, io_threads=1) as store:
        files = store._files
        store.put(keys(3), data[:3])
        store.put(keys(1), data[3:])  # replaces key 0: its deletion will take no record
        store.delete([keys(3)[1]])
        monkeypatch.setattr(os, "pwrite", failing_pwrite)
        assert not store.put([b"key-fail"], data[:1])[0].ok  # a failed write returns its promise
        monkeypatch.undo()
        for step in ("before", "after"):
            assert files.owed == record_cost(store._table.unwritten_keys()), step
            assert files.allocated >= files.journal_bytes + files.owed, step
            store.flush()
