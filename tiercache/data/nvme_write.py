"""The NVMe store's write path, and the disk space its dead chunk files hold.

``NVMeWrites`` is the half of ``NVMeStore`` that writes chunks (mixed into it; it uses the
store's index, lock, stats, codec and per-thread buffers). See ``nvme`` for the write
protocol and the crash guarantees.

Disk space. A slot freed by ``delete`` or by a replacing put keeps its chunk file: a dead
file, which holds no block a crash must keep once the slot is free (``SlotTable.dead_files``;
until a flush has made the slot's release durable, a crash may reopen the old block from
it, and no put may take the slot). The next write of the slot overwrites it in place (no
block allocation: the point of ``overwrite_in_place``) or renames a new file over it.

A write refused for lack of space (ENOSPC, EDQUOT: a journal reservation, a chunk file, a
snapshot at flush) removes the dead files of every free slot, and a chunk write the old
file of its own slot, then is tried once more (``_when_full``, ``_reclaim_space``): deleting
blocks always makes room again on a full disk. The old file of a slot being rewritten holds
no block a crash must keep either: its slot was free, or live and named by the put, which
dropped its key (``SlotTable.reserve_at``; reopen drops an entry whose chunk is missing, as
it drops one whose chunk was rewritten).

Dead files are not removed as soon as their slot is freed: in place, that would give up
the overwrite; rename-only, it moves the freeing of each file out of the put's rename (on
the I/O threads, in parallel) into the flush, one file after another (delete/flush/put
cycles of 16 blocks of 128 KiB on this machine's ext4 disk: 0.14 GB/s against 0.18, medians
of 11 runs). Until the disk fills, dead files take no more than the store's capacity, which
the disk must hold for the store to fill anyway, and reopen removes them.
"""

from __future__ import annotations

import errno
import os
import warnings
from typing import Callable, TypeVar

import numpy as np
import torch

from . import chunkio
from .buffers import byte_array
from .nvme_index import DISK_FULL, put_cost, record_cost
from .nvme_open import TMP_PREFIX
from .nvme_results import FailedWrite, PutResult

__all__ = ["NVMeWrites"]

T = TypeVar("T")


def folder_identity(path: str | int) -> tuple[int, int]:
    """The folder's device and inode (of its path, or of a descriptor holding it open):
    what its name must still lead to for a write there to be this store's
    (``NVMeWrites.check_folder``)."""
    found = os.stat(path)
    return found.st_dev, found.st_ino


class NVMeWrites:
    """Chunk writes of ``NVMeStore`` (see that class for the invariants they keep)."""

    def check_folder(self) -> None:
        """Raises OSError when the store's path no longer names the folder it opened (removed,
        or removed and made anew: by a clean-up script, say), before anything is written by
        that name: a flush would say blocks were durable that no reopen of the path finds.
        The check names the problem; the writes do not rely on it: every file is written
        relative to the folder the lock holds open (``folder_fd``), so one made after a
        replacement that races past this check still lands in the store's own folder (or
        fails, ``ENOENT``, once that folder is removed), never beside another store's.

        Raises:
            OSError: ``ENOENT`` (or what ``stat`` raised) when the path is gone, ``ESTALE``
                when it names another folder.
        """
        try:
            identity = folder_identity(self.path)
        except OSError as exc:
            error = OSError(exc.errno, f"{self.path}: the store's folder is gone ({exc.strerror}); nothing can be "
                                       "written or made durable there", self.path)
        else:
            if identity == self._folder:
                return
            error = OSError(errno.ESTALE, f"{self.path}: the store's folder was replaced since it was opened (the "
                                          "path names another folder now); nothing is written there", self.path)
        if not self._folder_warned:  # once: every later write fails the same way, each counted
            self._folder_warned = True
            warnings.warn(f"NVMeStore: {error}", RuntimeWarning, stacklevel=2)
        raise error

    def _write_one(self, key: bytes, slot: int, gen: int, block: torch.Tensor, named: bool = True,
                   encoded: bool = False) -> PutResult:
        """I/O thread: writes one chunk and publishes it; an OSError becomes the result.
        ``named``: the caller chose the slot (a durable entry may still name it);
        ``encoded``: ``block`` holds the codec's bytes already."""
        promised = 0
        try:
            self.check_folder()
            # a full disk refuses the block before its data
            self._when_full(lambda: self._files.promise(put_cost(key)))
            promised = put_cost(key)
            payload = self._codec.encode(self._chunk_payload(block, encoded))
            crc, renamed = self._when_full(lambda: self._write_chunk(slot, gen, payload, named), slot)
            length = payload.size + 4
        except OSError as exc:
            self._abandon(slot, promised, failed=True)
            path = exc.filename or (self.chunk_path(slot) if promised else self._files.journal_path)
            self.last_failed_write = FailedWrite(exc, os.fspath(path))  # one reference: no lock needed
            return PutResult(key, None, exc)
        except BaseException:
            self._abandon(slot, promised, failed=False)
            raise
        with self._lock:
            if self._table.lookup(key) is not None:  # replaced: its deletion takes no record
                self._files.settle(record_cost([key]))
            self._table.publish(key, slot, gen, length, crc)
            self._dir_dirty = self._dir_dirty or renamed
            self.stats["puts"] += 1
            self.stats["bytes_written"] += length
        return PutResult(key, slot)

    def _abandon(self, slot: int, promised: int, failed: bool) -> None:
        """A write that will not publish: its slot is free again, its journal space returned."""
        with self._lock:
            self._table.abandon(slot)
            self._files.settle(promised)
            self.stats["failed_writes"] += failed

    def _write_chunk(self, slot: int, gen: int, payload: np.ndarray, named: bool = True) -> tuple[int, bool]:
        """Durably writes one chunk: in place over a same-size chunk file when allowed (crc
        first in a slot the caller named), else temp file + rename. Returns (crc32c,
        whether a rename happened)."""
        final = self.chunk_path(slot)
        dir_fd = self.folder_fd
        crc = chunkio.overwrite_chunk_file(final, payload, named, dir_fd) if self.overwrite_in_place else None
        if crc is not None:
            return crc, False
        tmp = os.path.join(self.path, f"{TMP_PREFIX}{slot}.{gen}")
        return chunkio.write_chunk_file(tmp, final, payload, dir_fd), True

    def _chunk_payload(self, block: torch.Tensor, encoded: bool) -> np.ndarray:
        """The bytes of one chunk: the block's own, or the block encoded with the codec
        (into this thread's buffer), or the encoded bytes given."""
        if encoded or self._block_codec is None:
            return self._source_bytes(block)
        return byte_array(self._block_codec.encode_into(block, self._local.encoded))

    def _source_bytes(self, block: torch.Tensor) -> np.ndarray:
        """The block's bytes without a copy when it is contiguous host memory, else staged."""
        view = self._host_bytes(block)
        if view is not None:
            return view
        self._local.block.copy_(block)
        return byte_array(self._local.block)

    # ----- disk space ------------------------------------------------------------------

    def _when_full(self, write: Callable[[], T], own_slot: int | None = None) -> T:
        """``write()``; refused for lack of space, it is called once more if dead chunk files
        were removed since it started (``_reclaim_space(own_slot)`` now, or another thread).

        Raises:
            OSError: from the last call (the first, when nothing was removed).
        """
        removed = self.stats["chunks_reclaimed"]
        try:
            return write()
        except OSError as exc:
            if exc.errno not in DISK_FULL:
                raise
            self._reclaim_space(own_slot)
            if self.stats["chunks_reclaimed"] == removed:
                raise
        return write()

    def _reclaim_space(self, own_slot: int | None = None) -> int:
        """Removes the dead chunk files of free slots, giving their disk space back, and the
        old chunk file of ``own_slot`` (reserved by the caller, whose new chunk replaces it:
        a slot freed a moment ago is reserved again first, so its file would otherwise
        never be reclaimed); returns how many it removed (``stats["chunks_reclaimed"]``).

        Runs under the store lock, so that no put takes one of these slots while its file
        goes: rare (a full disk) and bounded by the free slots that hold a file. A later
        put of such a slot writes a new file (temp file + rename).
        """
        with self._lock:
            slots = self._table.dead_files() + ([] if own_slot is None else [own_slot])
            gone, removed = self._remove_chunks(slots)
            self._table.forget_files(gone)
            self.stats["chunks_reclaimed"] += removed
        return removed

    def _remove_chunks(self, slots: list[int]) -> tuple[list[int], int]:
        """Unlinks the chunk files of ``slots``. Returns the slots whose file is gone
        (removed, or not there) and how many were removed. A removal that fails otherwise
        (EIO) leaves the file to a later reclaim, or to reopen's sweep."""
        gone, removed = [], 0
        for slot in slots:
            try:
                chunkio.unlink(self.chunk_path(slot), self.folder_fd)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError:
                continue
            gone.append(slot)
        return gone, removed
