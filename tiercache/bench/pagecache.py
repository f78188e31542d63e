"""The page cache of a benchmark's files: what sits in it (``mincore``), and dropping it
(``fsync`` + ``POSIX_FADV_DONTNEED``), so that a "cold" read is checked to start with its files
out of memory (``decode.make_cold``, ``scripts/bench_store.py``, ``measure``)."""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Iterable

from ..data.chunkio import drop_file_cache

__all__ = ["page_cache_bytes", "cached_bytes_of", "cached_bytes_in", "evict_from_page_cache"]


def page_cache_bytes() -> int:
    """The kernel's file page cache: ``Cached`` minus ``Shmem`` of /proc/meminfo (shared
    anonymous memory, such as the DRAM and CPU-side HBM pools, is counted in ``Cached``
    but holds no file pages); 0 where unavailable."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("Cached", "Shmem"):
                    fields[name] = int(rest.split()[0]) * 1024
    except OSError:
        return 0
    return max(0, fields.get("Cached", 0) - fields.get("Shmem", 0))


def cached_bytes_of(folder: str) -> int:
    """Bytes of the files under ``folder`` that sit in the page cache now (``cached_bytes_in``
    over every file below it); 0 without libc."""
    paths = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]
    return cached_bytes_in(paths) or 0


def cached_bytes_in(paths: Iterable[str]) -> int | None:
    """Bytes of the files ``paths`` that sit in the page cache now: ``mincore`` over a
    read-only mapping of each file (the mapping itself reads nothing; a file that vanished
    counts 0). None without libc (residency unknown)."""
    libc = _libc()
    if libc is None:
        return None
    page = mmap.PAGESIZE
    return sum(_cached_pages(libc, path, page) * page for path in paths)


def evict_from_page_cache(paths: Iterable[str]) -> int | None:
    """Makes each file's pages clean (``fsync``) and drops them (``POSIX_FADV_DONTNEED``,
    which skips dirty pages: without the fsync freshly written files would stay cached);
    returns the bytes still cached afterwards (``cached_bytes_in``: 0 means a read that
    starts now is cold; None: unknown). Files that vanished are skipped."""
    paths = list(paths)
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        drop_file_cache(path)
    return cached_bytes_in(paths)


def _cached_pages(libc, path: str, page: int) -> int:
    """Resident pages of one file (0 if it vanished or cannot be mapped)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return 0
        try:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(address), size, vec) != 0:
                return 0
            return sum(v & 1 for v in vec)
        finally:
            libc.munmap(ctypes.c_void_p(address), size)
    finally:
        os.close(fd)


def _libc():
    """libc with mmap, mincore and munmap typed, or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None
