"""A read that fails with an I/O error (EIO) is a failed attempt, never a lost block: the
chunk stays stored and the error names the block and the OS error. Only a chunk proven
corrupt (length or crc32c) is dropped, and the stats say which of the two happened."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch

from store_helpers import LAYOUT, blocks, key, tiers
from tiercache import TieredKVStore
from tiercache.data import chunkio
from tiercache.data.nvme_results import ReadIOError

NVME = 2  # tier index of the NVMe store in ``tiers``


class ReadFaults:
    """Makes chunk reads fail with EIO: the next ``count`` reads, or every read of ``paths``."""

    def __init__(self, monkeypatch, count: int = 0, paths: tuple[str, ...] = (), delay: float = 0.0) -> None:
        self.count, self.paths, self.delay = count, set(paths), delay
        self._lock = threading.Lock()
        self._real = chunkio.read_chunk_file
        monkeypatch.setattr(chunkio, "read_chunk_file", self._read)

    def _read(self, path, *args, **kwargs):
        time.sleep(self.delay)
        with self._lock:
            fail = self.count > 0 or str(path) in self.paths
            self.count -= fail and self.count > 0
        if fail:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return self._real(path, *args, **kwargs)


def where(store: TieredKVStore, keys: list[bytes]) -> list[str | None]:
    return store.lookup(keys)[1]


def nvme_stats(store: TieredKVStore) -> tuple[int, int, int]:
    """(read_errors, corrupt_reads, deletes) of the NVMe tier."""
    stats = store.stats()["nvme"]
    return stats["read_errors"], stats["corrupt_reads"], stats["deletes"]


def chunk_of(store: TieredKVStore, k: bytes) -> str:
    medium = store._media[NVME]
    return str(medium.chunk_path(medium.slot_of(k)))


def test_eio_on_a_prefetch_the_cascade_waits_for_keeps_the_block(tmp_path, monkeypatch):
    """Finding 3: a put that makes room waits for a prefetch whose read failed with EIO;
    the block stays on NVMe (also after a reopen) instead of being deleted."""
    data, ks = blocks(5, 1), [key(i) for i in range(5)]
    with TieredKVStore(LAYOUT, tiers(1, 1, 3), path=tmp_path / "s", device="cpu") as store:
        store.put(ks[:4], data[:4])
        assert where(store, ks[:1]) == ["nvme"]
        faults = ReadFaults(monkeypatch, count=1, delay=0.2)
        store.prefetch(ks[:1])
        store.put(ks[4:], data[4:])  # makes room: waits for the failed prefetch
        faults.delay = 0.0
        assert where(store, ks[:1]) == ["nvme"]
        assert nvme_stats(store) == (1, 0, 0)
    monkeypatch.undo()
    with TieredKVStore(LAYOUT, tiers(1, 1, 3), path=tmp_path / "s", device="cpu") as store:
        assert where(store, ks[:1]) == ["nvme"]
        assert torch.equal(store.get(ks[:1]), data[:1])


def test_eio_on_an_in_place_read_names_the_error_and_keeps_the_block(tmp_path, monkeypatch):
    """Finding 3: a get that reads NVMe in place reports the I/O error (not "corrupt
    chunk"), keeps the block, and the next get serves it."""
    data, ks = blocks(4, 2), [key(i) for i in range(4)]
    with TieredKVStore(LAYOUT, tiers(1, 1, 2), path=tmp_path / "s", device="cpu") as store:
        store.put(ks, data)
        before = where(store, ks)
        ReadFaults(monkeypatch, count=1)
        with pytest.raises(ReadIOError, match=f"{ks[0].hex()} failed: Input/output error") as caught:
            store.get(ks)
        assert isinstance(caught.value, KeyError) and caught.value.errno == errno.EIO
        assert "corrupt" not in str(caught.value)
        assert where(store, ks) == before
        assert nvme_stats(store)[:2] == (1, 0)
        assert torch.equal(store.get(ks), data)


def test_eio_ends_get_prefix_without_dropping_the_block(tmp_path, monkeypatch):
    data, ks = blocks(4, 3), [key(i) for i in range(4)]
    with TieredKVStore(LAYOUT, tiers(1, 1, 2), path=tmp_path / "s", device="cpu") as store:
        store.put(ks, data)
        before = where(store, ks)
        ReadFaults(monkeypatch, count=1)
        assert len(store.get_prefix(ks)) == 0
        assert where(store, ks) == before
        assert torch.equal(store.get_prefix(ks), data)


def test_a_move_drops_the_corrupt_block_and_keeps_the_one_that_failed(tmp_path, monkeypatch):
    """One read job: one chunk fails with EIO, another is corrupt. Only the corrupt one is
    lost; the stats count one of each."""
    data, ks = blocks(6, 4), [key(i) for i in range(6)]
    with TieredKVStore(LAYOUT, tiers(2, 2, 4), path=tmp_path / "s", device="cpu") as store:
        store.put(ks, data)
        assert where(store, ks[:2]) == ["nvme", "nvme"]
        with open(chunk_of(store, ks[1]), "r+b") as f:
            f.seek(10)
            byte = f.read(1)
            f.seek(10)
            f.write(bytes([byte[0] ^ 0xFF]))
        ReadFaults(monkeypatch, paths=(chunk_of(store, ks[0]),))
        store.wait(store.prefetch(ks[:2]))
        assert where(store, ks[:2]) == ["nvme", None]
        assert nvme_stats(store)[:2] == (1, 1)
        monkeypatch.undo()
        assert torch.equal(store.get(ks[:1]), data[:1])
