"""Raw baselines for the tier benchmarks: what the hardware gives without tiercache.

Each baseline moves the same bytes, in the same block size, with the same concurrency as
the tiercache path it is compared with, so the benchmark can report honest ratios:

* ``RawBlockFiles.write`` / ``pwrite_loop``: ``os.pwrite`` of whole blocks over files laid
  out beforehand (as fio does; one file per writer thread, so writers do not queue on one
  inode's fdatasync), K threads; durable when the call returns, either with the store's
  policy (``SYNC_POLICY``: ``fdatasync`` after every block) or, with
  ``sync_each_block=False``, the raw limit for the same durability (``RAW_SYNC_POLICY``:
  one ``fdatasync`` per file once all its blocks are written). ``fresh=True`` writes new
  files instead (allocating space);
* ``RawBlockFiles.read`` / ``direct_read``: random-order O_DIRECT ``os.preadv`` of whole
  blocks into page-aligned (mmap) destinations, one distinct block of memory per block
  read, as a tier must deliver them (on this VM, reading every block into the same few
  reused buffers runs up to 1.5x faster, a speed no tier can use), K threads; falls back
  to buffered reads (and says so) when the filesystem refuses O_DIRECT.
* ``read_files``: the same O_DIRECT preadv loop over whole files (a store's own chunk
  files), so a comparison can read the very bytes tiercache reads;
* ``memmove_copy``: the host copy limit: one ``memmove`` of a contiguous buffer, or the
  buffer split over the threads of a ``RawPool``;
* ``host_copy``: one ``dst.copy_(src)`` of the same bytes (timed with CUDA events when a
  CUDA tensor is involved).

The threads of every multi-threaded baseline belong to a ``RawPool``, started once before
anything is timed (as the store keeps its I/O pool): a timed call never pays thread
start-up. Every read and write checks its byte count (a short transfer raises OSError).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..data.buffers import PAGE
from ..data.chunkio import drop_file_cache, open_for_read

__all__ = [
    "RawRun", "RawBlockFiles", "RawPool", "RAW_SYNC_POLICY", "SOURCE", "SYNC_POLICY", "direct_read", "pwrite_loop", "host_copy",
    "memmove_copy", "read_latency", "write_latency", "read_buffers", "read_files", "source_block", "workers_in_words",
]

#: The store's durability policy for chunk writes (``RawBlockFiles.write``'s default).
SYNC_POLICY = "fdatasync after every block"
#: The same durability (every block on disk when the write returns) at the raw limit:
#: DESIGN.md section 8, the raw writer syncs once per file (``sync_each_block=False``).
RAW_SYNC_POLICY = "one fdatasync per file once all its blocks are written"
#: What ``RawBlockFiles.holds`` records for a slot holding the files' own random block.
SOURCE = "source"


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


class RawPool:
    """Worker threads for the raw baselines, started once, before anything is timed.

    ``run(worker, count)`` runs ``worker(0)`` on the calling thread and ``worker(1)`` ..
    ``worker(count - 1)`` on the pool's ``threads - 1`` threads, all at once (they start
    together at a barrier, so no thread runs two of them). Invariant: every thread exists
    before the first ``run`` (a timed call never starts a thread).
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(threads - 1, "tiercache-raw") if threads > 1 else None
        if self._executor is not None:  # each task holds its thread until all have started
            started = threading.Barrier(threads - 1)
            for future in [self._executor.submit(started.wait) for _ in range(threads - 1)]:
                future.result()

    def run(self, worker: Callable[[int], object], count: int) -> float:
        """Runs ``worker(i)`` for ``i in range(count)`` concurrently; returns the wall time of all.

        Raises:
            ValueError: ``count`` exceeds ``threads`` (the workers could not run at once).
            OSError: the first error a worker hit (after every worker has stopped).
        """
        if not 1 <= count <= self.threads:
            raise ValueError(f"RawPool.run: {count} workers on a pool of {self.threads} threads")
        together = threading.Barrier(count)  # each task on its own thread: none picks up a second

        def task(i: int) -> object:
            together.wait()
            return worker(i)

        start = time.perf_counter()
        futures = [self._executor.submit(task, i) for i in range(1, count)] if count > 1 else []
        errors: list[BaseException] = []
        try:
            task(0)
        except BaseException as exc:  # re-raised once every worker has stopped
            errors.append(exc)
        errors += [exc for exc in (future.exception() for future in futures) if exc is not None]
        seconds = time.perf_counter() - start
        if errors:
            raise errors[0]
        return seconds

    def close(self) -> None:
        """Stops the threads (waits for them)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def workers_in_words(threads: int, smallest_call: int) -> str:
    """The raw loops' concurrency in words: ``threads``, and where some calls have fewer
    blocks, that they run one worker per block (``RawBlockFiles``: no idle worker)."""
    if smallest_call >= threads:
        return f"{threads} threads"
    return f"{threads} threads (one per block where a call has fewer: {max(1, smallest_call)} on the smallest)"


def memmove_copy(dst_address: int, src_address: int, nbytes: int, pool: RawPool | None = None) -> float:
    """Copies ``nbytes`` contiguous host bytes: one ``memmove`` (no pool, or one thread),
    else one ``memmove`` of an equal part per pool thread; returns seconds. ctypes drops
    the GIL for the call, so the parts run in parallel."""
    if pool is None or pool.threads == 1:
        start = time.perf_counter()
        ctypes.memmove(dst_address, src_address, nbytes)
        return time.perf_counter() - start
    part = -(-nbytes // pool.threads)

    def worker(index: int) -> None:
        offset = index * part
        ctypes.memmove(dst_address + offset, src_address + offset, max(0, min(part, nbytes - offset)))

    return pool.run(worker, pool.threads)


def _nbytes(buffer) -> int:
    return memoryview(buffer).nbytes


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
    writers never queue on one inode's fdatasync. Readers and writers are the threads of
    one ``RawPool`` of ``files`` threads, started here; ``close`` stops them.

    Invariants: ``holds[g]`` is the label of what slot ``g`` holds: ``SOURCE`` after
    ``lay_out`` or ``write(n)``, the caller's label after ``write(sources, labels)``, None
    when unknown (files not written through this object, or a write without labels);
    ``last_slots[i]`` is the global slot that ``sources[i]`` of the latest ``write`` went to.
    """

    def __init__(self, prefix: str, block_bytes: int, files: int, blocks_per_file: int, seed: int = 0) -> None:
        self.paths = [f"{prefix}.{k}" for k in range(files)]
        self.block_bytes = block_bytes
        self.blocks_per_file = blocks_per_file
        self.direct = True
        self._src = source_block(block_bytes, seed)
        self._cursor = [0] * files
        self.holds: list[object] = [None] * self.capacity
        self.last_slots = np.empty(0, dtype=np.int64)
        self._pool = RawPool(files)

    @property
    def source(self) -> mmap.mmap:
        """The files' own random block (what ``lay_out`` and ``write(n)`` write)."""
        return self._src

    def close(self) -> None:
        """Stops the reader/writer threads."""
        self._pool.close()

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
        self.holds = [None] * self.capacity

    def lay_out(self) -> None:
        """Writes every slot once (sequentially) and fsyncs, as fio lays out its files:
        later writes then overwrite allocated space."""
        for path in self.paths:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                for i in range(self.blocks_per_file):
                    _pwrite_all(fd, self._src, i * self.block_bytes)
                os.fsync(fd)
            finally:
                os.close(fd)
        self.holds = [SOURCE] * self.capacity
        self.drop_cache()

    def write(self, sources: list | int, labels: list | None = None, sync_each_block: bool = True) -> float:
        """Writes one block per entry of ``sources`` (each one block of memory; an int
        ``n`` writes this object's random block ``n`` times), one writer thread per file,
        every block durable when it returns: ``fdatasync`` after each block
        (``SYNC_POLICY``), or without ``sync_each_block`` once per file after its last block
        (``RAW_SYNC_POLICY``, the raw limit); returns seconds. ``holds`` then records
        ``labels[i]`` (None without labels; ``SOURCE`` for an int) for the slot ``sources[i]``
        went to, and ``last_slots[i]`` that global slot. Fewer blocks than files run as many
        writers as blocks, over the first files: a writer with nothing to write would only
        add an open, an ``fdatasync`` and a place at the start barrier to the time.

        Pass the very memory the tier writes from: on this VM, writing the same small
        buffer over and over runs faster than writing distinct memory, as a tier does.

        Raises:
            OSError: a write failed or was short.
        """
        if isinstance(sources, int):
            sources, labels = [self._src] * sources, [SOURCE] * sources
        tickets = iter(enumerate(zip(sources, labels if labels is not None else [None] * len(sources))))
        files = len(self.paths)
        writers = max(1, min(files, len(sources)))  # no writer without a block to write (nor its open, sync, barrier)
        fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644) for p in self.paths[:writers]]
        self.last_slots = np.full(len(sources), -1, dtype=np.int64)

        def worker(index: int) -> None:
            wrote = False
            for i, (source, label) in tickets:  # a shared iterator: each block goes to exactly one writer
                slot = self._cursor[index] % self.blocks_per_file
                self._cursor[index] += 1
                _pwrite_all(fds[index], source, slot * self.block_bytes)
                if sync_each_block:
                    os.fdatasync(fds[index])
                self.holds[slot * files + index], self.last_slots[i] = label, slot * files + index
                wrote = True
            if wrote and not sync_each_block:
                os.fdatasync(fds[index])

        try:
            return self._pool.run(worker, writers)
        finally:
            for fd in fds:
                os.close(fd)

    def read(self, slots: np.ndarray, dests: list, threads: int) -> float:
        """Reads global slot ``slots[i]`` into ``dests[i]`` (page aligned, one block) with
        O_DIRECT preadv (buffered if refused), ``threads`` readers (at most ``files``, and no
        more than there are slots), opening only the files the slots are in; returns seconds.
        Sets ``direct`` (for the files opened).

        Raises:
            OSError: a read failed or was short.
        """
        files, size = len(self.paths), self.block_bytes
        wanted = slots.tolist()
        opened = {k: open_for_read(self.paths[k], True) for k in sorted({slot % files for slot in wanted})}
        fds = {k: fd for k, (fd, _) in opened.items()}
        self.direct = all(direct for _, direct in opened.values())
        tickets = iter(zip(wanted, dests))

        def worker(_: int) -> None:
            for slot, dest in tickets:
                if os.preadv(fds[slot % files], [dest], slot // files * size) != size:
                    raise OSError(f"short read of slot {slot}")

        try:  # no reader without a block to read, and only the files the slots are in opened
            return self._pool.run(worker, max(1, min(threads, len(wanted))))
        finally:
            for fd in fds.values():
                os.close(fd)

    def drop_cache(self) -> None:
        """Evicts the files' pages from the page cache."""
        for path in self.paths:
            drop_file_cache(path)


def read_files(paths: list[str], dests: list, tails: list[mmap.mmap], pool: RawPool | None = None) -> tuple[float, bool]:
    """Reads whole files (a store's chunk files) with one O_DIRECT preadv each:
    ``paths[i]`` into ``[dests[i], tails[t]]`` (the block, then the rest of the file into
    reader ``t``'s page), one reader per tail buffer, from one shared queue, on ``pool``'s
    threads (at least ``len(tails)``; without one, a pool is started before the clock).

    Returns:
        ``(seconds, whether O_DIRECT was in effect for every file)``.

    Raises:
        OSError: a read failed, or a file ended before filling its ``dests[i]``.
    """
    tickets = iter(zip(paths, dests, [_nbytes(dest) for dest in dests]))
    buffered: list[str] = []
    readers = pool or RawPool(len(tails))

    def worker(index: int) -> None:
        for path, dest, want in tickets:
            fd, direct = open_for_read(path, True)
            try:
                got = os.preadv(fd, [dest, tails[index]], 0)
            finally:
                os.close(fd)
            if got < want:
                raise OSError(f"short read of {path}: {got} bytes, the block needs {want}")
            if not direct:
                buffered.append(path)

    try:
        return readers.run(worker, max(1, min(len(tails), len(paths)))), not buffered  # no reader without a file
    finally:
        if pool is None:
            readers.close()


def _pwrite_all(fd: int, source, offset: int) -> None:
    """One pwrite of the whole of ``source``; a short write raises OSError."""
    want, done = _nbytes(source), os.pwrite(fd, source, offset)
    if done != want:
        raise OSError(f"short write at offset {offset}: {done} of {want} bytes")


def _per_file(n_blocks: int, threads: int) -> int:
    return -(-n_blocks // threads)


def pwrite_loop(prefix: str, n_blocks: int, block_bytes: int, threads: int, fresh: bool = False) -> RawRun:
    """Durable writes of ``n_blocks`` blocks, ``threads`` writers, into laid-out files
    (overwrite, as fio measures) or, with ``fresh``, into new files (allocating)."""
    files = RawBlockFiles(prefix, block_bytes, threads, _per_file(n_blocks, threads))
    try:
        files.reset()
        if not fresh:
            files.lay_out()
        return RawRun(n_blocks * block_bytes, files.write(n_blocks))
    finally:
        files.close()


def direct_read(prefix: str, n_blocks: int, block_bytes: int, threads: int, seed: int = 0) -> RawRun:
    """Cold random-order reads of the blocks of files written by ``pwrite_loop(prefix, ...)``,
    each into its own page-aligned block of one destination mapping."""
    files = RawBlockFiles(prefix, block_bytes, threads, _per_file(n_blocks, threads))
    try:
        files.drop_cache()
        order = np.random.default_rng(seed).permutation(files.capacity)
        dest = np.frombuffer(_aligned(files.capacity * block_bytes), dtype=np.uint8)
        dests = [dest[i * block_bytes : (i + 1) * block_bytes] for i in range(files.capacity)]
        seconds = files.read(order, dests, threads)
        return RawRun(files.capacity * block_bytes, seconds, files.direct)
    finally:
        files.close()


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
            got = os.preadv(fd, [buf], int(slot) // count * files.block_bytes)
            times.append(time.perf_counter() - start)
            if got != PAGE:
                raise OSError(f"short read of {files.paths[int(slot) % count]}: {got} of {PAGE} bytes")
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
            _pwrite_all(fd, buf, i * PAGE)
            os.fdatasync(fd)
            times.append(time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(path)
    return float(np.median(times))
