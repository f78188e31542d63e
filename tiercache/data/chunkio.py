"""The NVMe store's on-disk format: a zarr v3 array with one chunk per block.

The store is a plain zarr v3 array ``[capacity, *block_shape]`` with chunks of exactly one
block, ``.``-separated chunk keys (``c.<slot>.0.0.0.0.0``, all files in one directory) and
the codec chain ``bytes(little) [-> blosc lz4 byte-shuffle] -> crc32c``. Any zarr tool
reads it. The hot path bypasses zarr's Python API (far too slow per chunk, see DESIGN.md
section 8) and reads and writes the chunk files itself in exactly the bytes zarr would:
the (compressed) payload followed by its crc32c as 4 little-endian bytes. Tests check both
directions against ``zarr.open_array``.

Layout dtypes zarr cannot express (bfloat16, float8) are stored as unsigned integers of
the same width; the true dtype is in the array attributes. A store with a block codec
(``Codec.INT8``, ``FP8``, ``INT4``) is a uint8 array ``[capacity, nbytes]``, one chunk per
encoded block (``tiercache.data.codecs``' serialised bytes, scales included); the codec is
in the attributes, and a store opened with another codec is refused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import glob
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass

import google_crc32c
import numcodecs
import numpy as np

from .chunkmeta import (  # noqa: F401 (re-exported: the format's names live in one module for callers)
    ATTR_KEY, COMPRESSIONS, FORMAT_VERSION, STORAGE_DTYPES, check_store, chunk_geometry, create_array,
    has_entry, layout_attributes, read_attributes)
from .libc import libc_function

__all__ = [
    "FORMAT_VERSION",
    "ATTR_KEY",
    "COMPRESSIONS",
    "STORAGE_DTYPES",
    "layout_attributes",
    "ChunkCodec",
    "create_array",
    "chunk_geometry",
    "read_attributes",
    "scan_folder",
    "has_entry",
    "check_store",
    "chunk_name",
    "parse_chunk_slot",
    "write_chunk_file",
    "open_file",
    "replace_file",
    "unlink",
    "unlink_quietly",
    "read_chunk_file",
    "open_for_read",
    "supports_direct",
    "read_small_file",
    "fsync_dir",
    "write_file_durably",
    "drop_file_cache",
    "crc32c",
]


def _load_crc32c_library():
    """The C function ``crc32c_value`` of the library google_crc32c bundles, or None.

    Called through ctypes, it runs without the GIL: the extension module releases the GIL
    only for ``bytes`` arguments, so on numpy views of blocks it would serialize every I/O
    thread behind each checksum (~50 us per MiB).
    """
    libs = os.path.join(os.path.dirname(os.path.dirname(google_crc32c.__file__)), "google_crc32c.libs")
    candidates = sorted(glob.glob(os.path.join(libs, "libcrc32c*"))) + [ctypes.util.find_library("crc32c")]
    for path in filter(None, candidates):
        try:
            function = ctypes.CDLL(path).crc32c_value
        except (OSError, AttributeError):
            continue
        function.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        function.restype = ctypes.c_uint32
        return function
    return None


_crc32c_value = _load_crc32c_library()
_GIL_FREE_MIN = 64 << 10  # below this the ctypes call costs more than it saves


def crc32c(data: np.ndarray) -> int:
    """crc32c of a contiguous uint8 numpy array, without a copy; large arrays are
    checksummed without holding the GIL."""
    if _crc32c_value is not None and data.size >= _GIL_FREE_MIN and data.flags.c_contiguous:
        return _crc32c_value(data.__array_interface__["data"][0], data.size)
    return google_crc32c.value(data)



def chunk_name(slot: int, ndim: int) -> str:
    """File name of the chunk holding ``slot`` (zarr default encoding, ``.`` separator)."""
    return "c." + str(slot) + ".0" * (ndim - 1)


def parse_chunk_slot(name: str, ndim: int) -> int | None:
    """The slot of a chunk file name, or None when the name is not a chunk of this array."""
    parts = name.split(".")
    if len(parts) != ndim + 1 or parts[0] != "c" or any(p != "0" for p in parts[2:]):
        return None
    return int(parts[1]) if parts[1].isdigit() else None


@dataclass(frozen=True)
class ChunkCodec:
    """Encodes and checks chunk bytes exactly as zarr's codec chain does.

    Invariant: ``encode`` output followed by ``decode_into`` gives back the block bytes;
    the last 4 bytes of every chunk are the crc32c (little endian) of the bytes before them
    (appended by the chunk writers).
    """

    block_bytes: int
    compression: str | None
    typesize: int

    @property
    def max_chunk_bytes(self) -> int:
        """Upper bound of an encoded chunk (blosc adds at most 16 bytes of header)."""
        extra = numcodecs.blosc.MAX_OVERHEAD if self.compression else 0
        return self.block_bytes + extra + 4

    def _blosc(self) -> numcodecs.Blosc:
        return numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE, blocksize=0)

    def encode(self, payload: np.ndarray) -> np.ndarray:
        """The bytes to write before the checksum (the block's bytes, or compressed)."""
        if self.compression == "lz4":
            return np.frombuffer(self._blosc().encode(payload), dtype=np.uint8)
        return payload

    def check(self, chunk: np.ndarray) -> int | None:
        """The crc of a whole chunk (payload + trailer) if it verifies, else None."""
        if chunk.size < 4:
            return None
        stored = int(chunk[-4:].view("<u4")[0])
        return stored if crc32c(chunk[:-4]) == stored else None

    def decode_into(self, chunk: np.ndarray, dest: np.ndarray) -> bool:
        """Decompresses a verified chunk's payload into ``dest``; False if it does not fit."""
        payload = chunk[:-4]
        if self.compression is None:
            if payload.size != dest.size:
                return False
            dest[:] = payload
            return True
        try:
            self._blosc().decode(payload, out=dest)
        except (RuntimeError, ValueError):
            return False
        return True


def _pwrite_all(fd: int, data, offset: int) -> None:
    """pwrite until every byte is written (a regular file may write short on a signal)."""
    view = memoryview(data).cast("B")
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


_sync_file_range = libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])  # runs without the GIL
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait


def _write_sealed(fd: int, payload: np.ndarray) -> int:
    """Writes ``payload`` then its crc32c (4 bytes, little endian) at offset 0; returns
    the crc.

    Writeback of the payload is started before the crc is computed, so the device works
    while the CPU checksums (the fdatasync that follows waits for all of it). The crc is
    computed after the payload write, while the payload is still in the CPU caches from
    the copy into the page cache: one pass over DRAM per block, not two.
    """
    _pwrite_all(fd, payload, 0)
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, payload.size, _SYNC_FILE_RANGE_WRITE)  # a hint: errors surface at fdatasync
    crc = crc32c(payload)
    _pwrite_all(fd, crc.to_bytes(4, "little"), payload.size)
    return crc


def _drop_written(fd: int) -> None:
    """Drops a durably written file's (now clean) pages from the page cache: the NVMe tier
    is read with O_DIRECT, so cached copies of its writes would only crowd out the memory
    the DRAM tier and the host need (a 10M-token sequence writes gigabytes)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _at(path: str, dir_fd: int | None) -> str:
    """What an ``os`` call given ``dir_fd`` opens: the file's name in the folder that
    descriptor holds open (every store file lies directly in its folder), so the call
    reaches the folder the store opened whatever its path names now; ``path`` without one."""
    return path if dir_fd is None else os.path.basename(path)


@contextmanager
def _naming(dir_fd: int | None, *paths: str):
    """An OSError of a call made relative to ``dir_fd`` names its files by their paths (as
    one made by path would): callers report ``exc.filename``."""
    try:
        yield
    except OSError as exc:
        if dir_fd is not None:
            by_name = {os.path.basename(p): p for p in paths}
            if exc.filename is not None:
                exc.filename = by_name.get(exc.filename, exc.filename)
            if exc.filename2 is not None:  # set to None, it would print as "-> None"
                exc.filename2 = by_name.get(exc.filename2, exc.filename2)
        raise


def open_file(path: str, flags: int, dir_fd: int | None = None, mode: int = 0o644) -> int:
    """``os.open`` of ``path``, or of its name in the folder ``dir_fd`` holds open (every store
    file lies directly in its folder); an OSError names ``path`` either way."""
    with _naming(dir_fd, path):
        return os.open(_at(path, dir_fd), flags, mode, dir_fd=dir_fd)


@contextmanager
def scan_folder(path: str, dir_fd: int | None = None):
    """``os.scandir`` of the folder ``path``, or of the folder ``dir_fd`` holds open (through
    a descriptor of its own, so that the held one's read position is never moved): its
    entries' ``name`` and ``stat`` are that folder's; their ``path`` is the name alone then."""
    if dir_fd is None:
        with os.scandir(path) as entries:
            yield entries
        return
    try:
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        exc.filename = path  # not ".": the folder the descriptor holds, by its path
        raise
    try:
        with os.scandir(fd) as entries:
            yield entries
    finally:
        os.close(fd)


def write_chunk_file(tmp_path: str, final_path: str, payload: np.ndarray, dir_fd: int | None = None) -> int:
    """Writes a chunk durably and atomically: temp file, fdatasync, rename over the chunk.

    The rename itself is made durable later by ``fsync_dir`` (batched at index flush).
    On any OSError the temp file is removed and the error re-raised; the chunk path then
    still holds whatever it held before. With ``dir_fd`` (the store's folder, held open),
    both files are that folder's, whatever their paths name meanwhile.

    Returns:
        The crc32c of ``payload`` (the chunk is ``payload.size + 4`` bytes).
    """
    fd = open_file(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd)
    try:
        try:
            crc = _write_sealed(fd, payload)
            os.fdatasync(fd)
            _drop_written(fd)
        finally:
            os.close(fd)
        replace_file(tmp_path, final_path, dir_fd)
    except OSError:
        unlink_quietly(tmp_path, dir_fd)
        raise
    return crc


def replace_file(src_path: str, dst_path: str, dir_fd: int | None = None) -> None:
    """``os.replace`` (``dir_fd``: as ``write_chunk_file``; both files lie in that folder)."""
    with _naming(dir_fd, src_path, dst_path):
        os.replace(_at(src_path, dir_fd), _at(dst_path, dir_fd), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def overwrite_chunk_file(path: str, payload: np.ndarray, crc_first: bool = True, dir_fd: int | None = None) -> int | None:
    """Overwrites an existing chunk file of the same length in place, durably.

    Same-size overwrite needs no block allocation or size change, so fdatasync flushes
    data only (no filesystem journal commit): on ext4 this is the difference between
    the raw disk's overwrite speed and its much slower allocate-and-commit speed. Crash
    safety comes from the index: the slot is not published (or its durable entry carries
    the old crc) until this returns, and reads verify length and crc against the index.

    With ``crc_first`` (a slot the caller named, which a durable index entry may still
    name with its old crc), the crc trailer is written before the payload, and reopen
    adopts an entry only if the trailer matches it: a process killed at any point of the
    write leaves a trailer that no longer matches the old entry (unless the bytes are the
    same), so reopen drops it instead of adopting bytes that are partly new. (Power loss
    may reorder page writeback; reads still verify the whole chunk.) That costs one more
    pass over the payload. A slot the store chose itself is free only once the deletion
    that freed it is durable, so no durable entry names it: the payload goes first, its
    writeback overlapping the crc (``_write_sealed``). ``dir_fd``: as ``write_chunk_file``.

    Returns:
        The crc32c of ``payload``, or None (nothing written) when the file is absent or
        has another length.
    """
    try:  # O_NOFOLLOW: never write through a symlink to a file outside the store
        fd = open_file(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd)
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size != payload.size + 4:
            return None
        if crc_first:
            crc = crc32c(payload)
            _pwrite_all(fd, crc.to_bytes(4, "little"), payload.size)
            _pwrite_all(fd, payload, 0)
        else:
            crc = _write_sealed(fd, payload)
        os.fdatasync(fd)
        _drop_written(fd)
    finally:
        os.close(fd)
    return crc


def unlink(path: str, dir_fd: int | None = None) -> None:
    """``os.unlink`` (``dir_fd``: as ``write_chunk_file``)."""
    with _naming(dir_fd, path):
        os.unlink(_at(path, dir_fd), dir_fd=dir_fd)


def unlink_quietly(path: str, dir_fd: int | None = None) -> None:
    """Removes a file, if it is there (best effort)."""
    try:
        unlink(path, dir_fd)
    except OSError:
        pass  # already gone, or the disk is failing: reopen sweeps leftovers


def open_for_read(path: str, direct: bool, dir_fd: int | None = None) -> tuple[int, bool]:
    """Opens a file for reading, with O_DIRECT when asked and the filesystem allows it.

    Returns:
        ``(fd, direct)`` where ``direct`` says whether O_DIRECT is in effect.
    """
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return open_file(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC, dir_fd), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: the filesystem refuses O_DIRECT (tmpfs)
                raise
    return open_file(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd), False


def supports_direct(path: str, dir_fd: int | None = None) -> bool:
    """True when the filesystem holding ``path`` (an existing file; ``dir_fd``: as
    ``write_chunk_file``) accepts O_DIRECT."""
    fd, direct = open_for_read(path, True, dir_fd)
    os.close(fd)
    return direct


def read_small_file(path: str, dir_fd: int | None = None) -> bytes:
    """The whole of a small file (``dir_fd``: as ``write_chunk_file``); its descriptor is
    closed whatever happens (a directory by that name raises ``IsADirectoryError`` naming
    ``path``, and leaks nothing)."""
    fd = open_file(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd)
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        parts = []
        while chunk := os.read(fd, 1 << 20):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def read_chunk_file(path: str, buffers: list, direct: bool, dir_fd: int | None = None) -> tuple[int, bool]:
    """Reads a chunk file into ``buffers`` with one preadv from offset 0 (``dir_fd``: as
    ``write_chunk_file``).

    With O_DIRECT every buffer must be page aligned in address and length; a chunk file is
    shorter than the buffers, and the read simply stops at end of file.

    Returns:
        ``(bytes read, whether O_DIRECT was used)``.
    """
    fd, used_direct = open_for_read(path, direct, dir_fd)
    try:
        return os.preadv(fd, buffers, 0), used_direct
    finally:
        os.close(fd)


def fsync_dir(path: str, dir_fd: int | None = None) -> None:
    """Makes renames and unlinks inside directory ``path`` durable (the folder ``dir_fd``
    holds open, when given)."""
    if dir_fd is not None:
        os.fsync(dir_fd)
    else:
        fsync_path(path, os.O_DIRECTORY)


def fsync_path(path: str, flags: int = os.O_NOFOLLOW) -> None:
    """Makes a file durable (no symlink; the caller fsyncs its directory), or a directory's entries."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: str, data: bytes, dir_fd: int | None = None) -> None:
    """Writes a small file and fsyncs it (the caller fsyncs the directory; ``dir_fd``: as
    ``write_chunk_file``)."""
    fd = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_file_cache(path: str, dir_fd: int | None = None) -> None:
    """Evicts one file's clean pages from the page cache (never the system-wide cache)."""
    try:
        fd = open_file(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd)
    except FileNotFoundError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
