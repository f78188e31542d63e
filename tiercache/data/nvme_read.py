"""The NVMe store's read path: batched, verified reads from the I/O threads.

``NVMeReads`` is the half of ``NVMeStore`` that reads (mixed into it; it uses the store's
index, lock, stats, executor and per-thread buffers). A read verifies the chunk's length
and crc32c against the index entry before the block counts as a hit: torn, stale or flipped
bytes are a miss (``stats["corrupt_reads"]``; the entry is forgotten), never data, and a
miss leaves zeros, not bytes that look like a block. A read that fails with an I/O error
(EIO, ...) proves nothing about the bytes: it is counted in ``stats["read_errors"]``, the
entry stays, and the batch's future raises ``ReadIOError`` naming the block and the error.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Sequence

import numpy as np
import torch

from . import chunkio
from .buffers import block_list, byte_array, is_aligned, normal_tensors
from .iojobs import run_batch
from .nvme_index import Entry
from .nvme_results import ReadIOError

__all__ = ["NVMeReads"]


class NVMeReads:
    """Reads of ``NVMeStore`` (see that class for the invariants they keep)."""

    def submit_get(self, keys: Sequence[bytes], out: torch.Tensor | Sequence[torch.Tensor]) -> Future:
        """Starts reading the blocks of ``keys`` into ``out``; returns a future of a bool array.

        ``out`` is a tensor ``[len(keys), *block_shape]`` or a list of per-block tensors
        (e.g. DRAM pool views). ``hits[i]`` False means absent, corrupt, or deleted while
        being read: ``out[i]`` then holds no block (zeroed if bytes were read).

        Raises:
            UserError: keys not bytes, ``out`` of wrong dtype/shape/count.
            ReadIOError: (from the future) a read failed with an I/O error; those blocks
                stay stored, and every block of the batch was still attempted.
        """
        self._check_open()
        keys = self._check_keys(keys, "NVMeStore.get")
        return self._submit_get(keys, block_list(out, self.layout, len(keys), "NVMeStore.get out"), encoded=False)

    def submit_get_encoded(self, keys: Sequence[bytes], out: Sequence[torch.Tensor]) -> Future:
        """``submit_get`` of the stored bytes as they are (the codec's encoding, not
        dequantised) into 1-D uint8 host tensors of ``chunk_bytes``; a future of the hit mask.

        Raises:
            UserError: keys not bytes, or a buffer that is not ``chunk_bytes`` of uint8.
        """
        self._check_open()
        keys = self._check_keys(keys, "NVMeStore.get_encoded")
        return self._submit_get(keys, self._check_encoded(out, len(keys), "NVMeStore.get_encoded"), encoded=True)

    def _submit_get(self, keys: list[bytes], dests: list[torch.Tensor], encoded: bool) -> Future:
        with self._lock:
            entries = [self._table.lookup(k) for k in keys]
            self.stats["gets"] += len(keys)
            self.stats["misses"] += sum(e is None for e in entries)
        found = [i for i, e in enumerate(entries) if e is not None]

        def finish(results: list[bool | OSError]) -> np.ndarray:
            hits = np.zeros(len(keys), dtype=bool)
            hits[found] = [r is True for r in results]
            failed = {keys[found[j]]: r for j, r in enumerate(results) if isinstance(r, OSError)}
            if failed:
                raise ReadIOError(failed, frozenset(k for k, hit in zip(keys, hits) if not hit and k not in failed))
            return hits

        return run_batch(self._executor, self._io_threads, len(found),
                         lambda j: self._read_one(keys[found[j]], entries[found[j]], dests[found[j]], encoded), finish)

    def get(self, keys: Sequence[bytes], out: torch.Tensor | Sequence[torch.Tensor]) -> np.ndarray:
        """Blocking ``submit_get``: returns the hit mask (bool array, one per key); raises
        ``ReadIOError`` if a read failed with an I/O error (the block stays stored)."""
        return self.submit_get(keys, out).result()

    def _read_one(self, key: bytes, entry: Entry, dest: torch.Tensor, encoded: bool = False) -> bool | OSError:
        """I/O thread: reads and verifies one chunk into ``dest``; True only for a good block.
        With a codec, the chunk is dequantised into ``dest`` unless ``encoded`` asks for its bytes.

        A missing file (a concurrent delete) is a miss (False). A failed read says nothing
        about the bytes: not corruption, so the entry stays and the OSError is returned for
        the batch to raise. Either way ``dest`` is zeroed.
        """
        try:
            if encoded or self._block_codec is None:
                return self._finish_read(key, entry, dest, self._read_verified(entry, dest))
            good = self._read_verified(entry, self._local.encoded)
            if good:
                self._block_codec.decode_from(self._local.encoded, self._dtype, dest)
            return self._finish_read(key, entry, dest, good)
        except OSError as exc:
            gone = isinstance(exc, FileNotFoundError)  # the chunk went away with a concurrent delete
            with self._lock:
                self.stats["misses"] += 1
                self.stats["read_errors"] += not gone
            dest.zero_()
            return False if gone else exc

    def _finish_read(self, key: bytes, entry: Entry, dest: torch.Tensor, good: bool) -> bool:
        """Counts the read; a bad chunk still named by the index is corrupt and forgotten."""
        with self._lock:
            current = self._table.is_current(entry)
            if good and current:
                self.stats["hits"] += 1
                self.stats["bytes_read"] += entry.length
                return True
            self.stats["misses"] += 1
            if current:  # the index still names these bytes, so they are damaged on disk
                self.stats["corrupt_reads"] += 1
                self._table.delete(key)
        dest.zero_()  # never leave bytes that look like a block in a miss
        return False

    def _read_verified(self, entry: Entry, dest: torch.Tensor) -> bool:
        """Reads the chunk of ``entry`` and checks length and crc32c; decodes into ``dest``."""
        path = self.chunk_path(entry.slot)
        local = self._local
        if self._can_read_in_place(dest):
            data = self._host_bytes(dest)
            n, _ = chunkio.read_chunk_file(path, [data, local.trailer], self.direct_io, self.folder_fd)
            stored = int(local.trailer[:4].view("<u4")[0])
            return n == entry.length and stored == entry.crc and chunkio.crc32c(data) == entry.crc
        n, _ = chunkio.read_chunk_file(path, [local.chunk], self.direct_io, self.folder_fd)
        chunk = local.chunk[:n]
        if n != entry.length or self._codec.check(chunk) != entry.crc:
            return False
        if dest.device.type == "cpu" and dest.is_contiguous():
            return self._codec.decode_into(chunk, byte_array(dest))
        if not self._codec.decode_into(chunk, byte_array(local.block)):
            return False
        dest.copy_(local.block)
        return True

    def _can_read_in_place(self, dest: torch.Tensor) -> bool:
        """O_DIRECT straight into the destination needs uncompressed chunks and a
        page-aligned, contiguous host destination of a whole number of pages."""
        return self._in_place_layout and dest.is_cpu and dest.is_contiguous() and is_aligned(dest)

    def read_block(self, slot: int, key: bytes, dest: torch.Tensor) -> None:
        """Reads ``key``'s block into ``dest`` (any device).

        Raises:
            ReadIOError: the read failed with an I/O error; the block stays stored.
            KeyError: the chunk is absent, or proved corrupt (and was forgotten).
        """
        if dest.device.type == "cpu":
            host = dest
        else:
            with normal_tensors():  # the I/O threads fill it, outside any inference mode
                host = torch.empty_like(dest, device="cpu")
        if not self.get([key], [host])[0]:
            raise KeyError(f"key {key.hex()} is stored but unreadable (corrupt or missing chunk)")
        if host is not dest:
            dest.copy_(host)
