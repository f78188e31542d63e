"""Raw baselines for the tier benchmarks: what the hardware gives without tiercache.

Each baseline moves the same bytes, in the same block size, with the same concurrency as
the tiercache path it is compared with, so the benchmark can report honest ratios:

* ``RawBlockFiles.write`` / ``pwrite_loop``: ``os.pwrite`` of whole blocks over files laid
  out beforehand (as fio does; one file per writer thread, so writers do not queue on one
  inode's fdatasync), K threads, with the store's durability policy: ``fdatasync`` after
  every block. ``fresh=True`` writes new files instead (allocating space);
* ``RawBlockFiles.read`` / ``direct_read``: random-order O_DIRECT ``os.preadv`` of whole
  blocks into page-aligned (mmap) destinations, one distinct block of memory per block
  read, as a tier must deliver them (on this VM, reading every block into the same few
  reused buffers runs up to 1.5x faster, a speed no tier can use), K threads; falls back
  to buffered reads (and says so) when the filesystem refuses O_DIRECT.
* ``read_files``: the same O_DIRECT preadv loop over whole files (a store's own chunk
  files), so a comparison can read the very bytes tiercache reads;
* ``host_copy``: one ``dst.copy_(src)`` of the same bytes (timed with CUDA events when a
  CUDA tensor is involved).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..data.buffers import PAGE
from ..data.chunkio import drop_file_cache, open_for_read

__all__ = [
    "RawRun", "RawBlockFiles", "SYNC_POLICY", "direct_read", "pwrite_loop", "host_copy", "read_latency",
    "write_latency", "read_buffers", "read_files", "source_block",
]

# The durability policy shared by the store's chunk writes and the raw write baseline.
SYNC_POLICY = "fdatasync after every block"


@dataclass(frozen=True)
class RawRun:
    """One timed run: bytes moved, seconds, and whether O_DIRECT was in effect."""

    nbytes: int
    seconds: float
    direct: bool = False

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9


def _aligned(nbytes: int) -> mmap.mmap:
    """An anonymous mapping: page aligned, as O_DIRECT requires."""
    return mmap.mmap(-1, max(nbytes, PAGE))


def _fill_random(buf: mmap.mmap, seed: int) -> None:
    """Incompressible content, so no layer below can shortcut the copy."""
    array = np.frombuffer(buf, dtype=np.uint8)
    array[:] = np.random.default_rng(seed).integers(0, 256, array.size, dtype=np.uint8)


def _run_threads(worker, threads: int) -> float:
    """Runs ``worker(i)`` on ``threads`` threads; returns the wall time of all.

    Raises:
        OSError: the first error a worker hit (after every worker has stopped).
    """
    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            worker(index)
        except BaseException as exc:  # re-raised on the calling thread below
            errors.append(exc)

    pool = [threading.Thread(target=guarded, args=(i,)) for i in range(threads)]
    start = time.perf_counter()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def source_block(block_bytes: int, seed: int = 0) -> mmap.mmap:
    """A page-aligned block of random bytes to write."""
    src = _aligned(block_bytes)
    _fill_random(src, seed)
    return src


def read_buffers(block_bytes: int, threads: int) -> list[mmap.mmap]:
    """One page-aligned block buffer per reader thread."""
    return [_aligned(block_bytes) for _ in range(threads)]


class RawBlockFiles:
    """Block-sized slots in plain files, the raw counterpart of the store's chunk files.

    ``files`` files of ``blocks_per_file`` slots each; global slot ``g`` is in file
    ``g % files`` at offset ``(g // files) * block_bytes``. Writers and readers take work
    from one shared queue (as the store's I/O pool does), so no thread idles while another
    has a backlog. Each writer writes only its own file, at its next slot (wrapping), so
    writers never queue on one inode's fdatasync.
    """

    def __init__(self, prefix: str, block_bytes: int, files: int, blocks_per_file: int, seed: int = 0) -> None:
        self.paths = [f"{prefix}.{k}" for k in range(files)]
        self.block_bytes = block_bytes
        self.blocks_per_file = blocks_per_file
        self.direct = True
        self._src = source_block(block_bytes, seed)
        self._cursor = [0] * files

    @property
    def capacity(self) -> int:
        """Slots over all files."""
        return len(self.paths) * self.blocks_per_file

    def reset(self) -> None:
        """Removes the files, so the next writes allocate new space."""
        for path in self.paths:
            if os.path.exists(path):
                os.unlink(path)
        self._cursor = [0] * len(self.paths)

    def lay_out(self) -> None:
        """Writes every slot once (sequentially) and fsyncs, as fio lays out its files:
        later writes then overwrite allocated space."""
        for path in self.paths:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                for i in range(self.blocks_per_file):
                    os.pwrite(fd, self._src, i * self.block_bytes)
                os.fsync(fd)
            finally:
                os.close(fd)
        self.drop_cache()

    def write(self, sources: list | int) -> float:
        """Writes one block per entry of ``sources`` (each one block of memory; an int
        ``n`` writes this object's random block ``n`` times), fdatasync after each, one
        writer thread per file; returns seconds.

        Pass the very memory the tier writes from: on this VM, writing the same small
        buffer over and over runs faster than writing distinct memory, as a tier does.
        """
        tickets = iter([self._src] * sources if isinstance(sources, int) else sources)
        fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644) for p in self.paths]

        def worker(index: int) -> None:
            for source in tickets:  # a shared iterator: each block goes to exactly one writer
                slot = self._cursor[index] % self.blocks_per_file
                self._cursor[index] += 1
                os.pwrite(fds[index], source, slot * self.block_bytes)
                os.fdatasync(fds[index])

        try:
            return _run_threads(worker, len(fds))
        finally:
            for fd in fds:
                os.close(fd)

    def read(self, slots: np.ndarray, dests: list, threads: int) -> float:
        """Reads global slot ``slots[i]`` into ``dests[i]`` (page aligned, one block) with
        O_DIRECT preadv (buffered if refused), ``threads`` readers; returns seconds.
        Sets ``direct``."""
        files, size = len(self.paths), self.block_bytes
        opened = [open_for_read(p, True) for p in self.paths]
        fds = [fd for fd, _ in opened]
        self.direct = all(direct for _, direct in opened)
        tickets = iter(zip(slots.tolist(), dests))

        def worker(_: int) -> None:
            for slot, dest in tickets:
                if os.preadv(fds[slot % files], [dest], slot // files * size) != size:
                    raise OSError(f"short read of slot {slot}")

        try:
            return _run_threads(worker, threads)
        finally:
            for fd in fds:
                os.close(fd)

    def drop_cache(self) -> None:
        """Evicts the files' pages from the page cache."""
        for path in self.paths:
            drop_file_cache(path)


def read_files(paths: list[str], dests: list, tails: list[mmap.mmap]) -> tuple[float, bool]:
    """Reads whole files (a store's chunk files) with one O_DIRECT preadv each:
    ``paths[i]`` into ``[dests[i], tails[t]]`` (the block, then the rest of the file into
    reader ``t``'s page), one reader thread per tail buffer, from one shared queue.

    Returns:
        ``(seconds, whether O_DIRECT was in effect for every file)``.
    """
    tickets = iter(zip(paths, dests))
    buffered: list[str] = []

    def worker(index: int) -> None:
        for path, dest in tickets:
            fd, direct = open_for_read(path, True)
            try:
                os.preadv(fd, [dest, tails[index]], 0)
            finally:
                os.close(fd)
            if not direct:
                buffered.append(path)

    return _run_threads(worker, len(tails)), not buffered


def _per_file(n_blocks: int, threads: int) -> int:
    return -(-n_blocks // threads)


def pwrite_loop(prefix: str, n_blocks: int, block_bytes: int, threads: int, fresh: bool = False) -> RawRun:
    """Durable writes of ``n_blocks`` blocks, ``threads`` writers, into laid-out files
    (overwrite, as fio measures) or, with ``fresh``, into new files (allocating)."""
    files = RawBlockFiles(prefix, block_bytes, threads, _per_file(n_blocks, threads))
    files.reset()
    if not fresh:
        files.lay_out()
    return RawRun(n_blocks * block_bytes, files.write(n_blocks))


def direct_read(prefix: str, n_blocks: int, block_bytes: int, threads: int, seed: int = 0) -> RawRun:
    """Cold random-order reads of the blocks of files written by ``pwrite_loop(prefix, ...)``,
    each into its own page-aligned block of one destination mapping."""
    files = RawBlockFiles(prefix, block_bytes, threads, _per_file(n_blocks, threads))
    files.drop_cache()
    order = np.random.default_rng(seed).permutation(files.capacity)
    dest = np.frombuffer(_aligned(files.capacity * block_bytes), dtype=np.uint8)
    dests = [dest[i * block_bytes : (i + 1) * block_bytes] for i in range(files.capacity)]
    seconds = files.read(order, dests, threads)
    return RawRun(files.capacity * block_bytes, seconds, files.direct)


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> RawRun:
    """One ``dst.copy_(src)`` of the whole tensor; CUDA events time it when CUDA is involved."""
    nbytes = src.numel() * src.element_size()
    if dst.device.type == "cuda" or src.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        return RawRun(nbytes, start.elapsed_time(end) / 1e3)
    start_s = time.perf_counter()
    dst.copy_(src)
    return RawRun(nbytes, time.perf_counter() - start_s)


def read_latency(files: RawBlockFiles, samples: int = 32, seed: int = 0) -> float:
    """Median seconds of one cold 4 KiB O_DIRECT read at a random slot of ``files``."""
    files.drop_cache()
    buf = _aligned(PAGE)
    count = len(files.paths)
    times = []
    for slot in np.random.default_rng(seed).integers(0, files.capacity, samples):
        fd, _ = open_for_read(files.paths[int(slot) % count], True)
        try:
            start = time.perf_counter()
            os.preadv(fd, [buf], int(slot) // count * files.block_bytes)
            times.append(time.perf_counter() - start)
        finally:
            os.close(fd)
    return float(np.median(times))


def write_latency(path: str, samples: int = 32) -> float:
    """Median seconds of one 4 KiB pwrite followed by fdatasync (the store's policy)."""
    buf = _aligned(PAGE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    times = []
    try:
        for i in range(samples):
            start = time.perf_counter()
            os.pwrite(fd, buf, i * PAGE)
            os.fdatasync(fd)
            times.append(time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(path)
    return float(np.median(times))
