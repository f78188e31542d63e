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
import json
import os
from dataclasses import dataclass

import google_crc32c
import numcodecs
import numpy as np

from ..config import CODEC_FORMATS, Codec, KVLayout
from ..errors import UserError
from .libc import libc_function

__all__ = [
    "FORMAT_VERSION",
    "STORAGE_DTYPES",
    "ChunkCodec",
    "create_array",
    "chunk_geometry",
    "read_attributes",
    "check_store",
    "chunk_name",
    "parse_chunk_slot",
    "write_chunk_file",
    "unlink_quietly",
    "read_chunk_file",
    "open_for_read",
    "supports_direct",
    "fsync_dir",
    "write_file_durably",
    "drop_file_cache",
    "crc32c",
]

FORMAT_VERSION = 1
ATTR_KEY = "tiercache"
COMPRESSIONS = (None, "lz4")
STORAGE_DTYPES = {
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
    "int8": "int8",
    "uint8": "uint8",
    "bfloat16": "uint16",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
}


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


def chunk_geometry(layout: KVLayout, codec: Codec = Codec.NONE) -> tuple[tuple[int, ...], str, int]:
    """``(chunk shape, zarr data type, bytes)`` of one block stored with ``codec``."""
    if codec is Codec.NONE:
        return tuple(layout.block_shape), STORAGE_DTYPES[layout.dtype], layout.block_bytes
    nbytes = codec.block_bytes(layout)
    return (nbytes,), "uint8", nbytes


def layout_attributes(layout: KVLayout, compression: str | None, codec: Codec = Codec.NONE) -> dict:
    """What the store records about itself in the zarr attributes (compared on reopen)."""
    return {
        "format_version": FORMAT_VERSION,
        "layout": {
            "layers": layout.layers,
            "kv_heads": layout.kv_heads,
            "head_dim": layout.head_dim,
            "dtype": layout.dtype,
            "block_tokens": layout.block_tokens,
            "per_layer": layout.per_layer,
        },
        "compression": compression,
        "codec": codec.value,
        "codec_format": CODEC_FORMATS[codec.value],
        "model": layout.name,  # two models of one shape must not read each other's KV
    }


def create_array(path: str, layout: KVLayout, capacity: int, compression: str | None, codec: Codec = Codec.NONE) -> None:
    """Creates the zarr v3 array (its ``zarr.json``) at ``path``; writes no chunk.

    Called once per store, off the hot path, so importing zarr here costs nothing later.
    """
    import zarr
    from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec

    block, dtype, _ = chunk_geometry(layout, codec)
    compressors = [Crc32cCodec()]
    if compression == "lz4":
        typesize = np.dtype(dtype).itemsize
        compressors.insert(0, BloscCodec(cname="lz4", clevel=5, shuffle="shuffle", typesize=typesize))
    zarr.create_array(
        store=path,
        shape=(capacity, *block),
        chunks=(1, *block),
        dtype=dtype,
        fill_value=0,
        serializer=BytesCodec(endian="little"),
        compressors=compressors,
        filters=None,
        chunk_key_encoding={"name": "default", "separator": "."},
        attributes={ATTR_KEY: layout_attributes(layout, compression, codec)},
    )


def read_attributes(path: str) -> tuple[tuple[int, ...], dict, dict]:
    """Reads an existing store's array shape, tiercache attributes and whole metadata.

    Raises:
        UserError: ``zarr.json`` unreadable, not a JSON object, not an array written by
            tiercache, or with a shape that is not a list of integers (names the file).
    """
    meta_path = os.path.join(path, "zarr.json")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"{meta_path}: not a readable zarr store ({exc})") from None
    if not isinstance(meta, dict):
        raise UserError(f"{meta_path}: not a zarr store: the metadata is a JSON {type(meta).__name__}, not an object")
    attrs = meta.get("attributes")
    attrs = attrs.get(ATTR_KEY) if isinstance(attrs, dict) else None
    if meta.get("node_type") != "array" or not isinstance(attrs, dict):
        raise UserError(f"{meta_path}: a zarr store, but not one written by tiercache (no '{ATTR_KEY}' attributes)")
    return _int_list(meta_path, meta.get("shape"), "shape"), attrs, meta


def _int_list(meta_path: str, value: object, what: str) -> tuple[int, ...]:
    """``value`` as a tuple of ints; UserError naming the file unless it is a JSON list of
    integers (``true`` is not an integer here)."""
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise UserError(f"{meta_path}: {what} must be a list of integers, got {value!r}")
    return tuple(value)


def _chunk_shape(meta: dict) -> object:
    """``chunk_grid.configuration.chunk_shape`` of zarr metadata, or None if absent."""
    grid = meta.get("chunk_grid")
    config = grid.get("configuration") if isinstance(grid, dict) else None
    return config.get("chunk_shape") if isinstance(config, dict) else None


def check_store(path: str, layout: KVLayout, compression: str | None, capacity: int | None,
                codec: Codec = Codec.NONE) -> int:
    """Checks an existing store against what the caller asks for; returns its capacity.

    A store written before codecs were recorded holds plain blocks (codec ``none``); one
    written before models were recorded (``model``, ``KVLayout.name``) opens under any name.

    Raises:
        UserError: another format version, layout, model name, compression, codec, capacity, array
            shape, chunk shape or data type (the message names ``zarr.json`` and gives
            stored and asked values).
    """
    shape, attrs, meta = read_attributes(path)
    meta_path = os.path.join(path, "zarr.json")
    wanted = layout_attributes(layout, compression, codec)
    if attrs.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{meta_path}: store format {attrs.get('format_version')!r}, this tiercache reads {FORMAT_VERSION}")
    if attrs.get("layout") != wanted["layout"]:
        raise UserError(f"{meta_path}: store holds layout {attrs.get('layout')}, asked for {wanted['layout']}")
    stored_model = attrs.get("model")  # stores from before the attribute name no model
    if stored_model is not None and stored_model != layout.name:
        raise UserError(f"{meta_path}: store holds KV of model {stored_model!r}, asked for model {layout.name!r} (same "
                        "shape, but another model's KV is not this one's); open it with that model's layout, or give "
                        "this model another directory")
    if attrs.get("compression") != compression:
        raise UserError(f"{meta_path}: store compression is {attrs.get('compression')!r}, asked for {compression!r}")
    stored_codec = attrs.get("codec", Codec.NONE.value)
    if stored_codec != codec.value:
        raise UserError(f"{meta_path}: store holds blocks encoded with codec {stored_codec!r}, asked for codec "
                        f"{codec.value!r}; open it with codec {stored_codec!r} (its blocks cannot be re-encoded in "
                        "place) or give the tier another directory")
    stored_format = attrs.get("codec_format", 1)  # stores from before the attribute hold format 1
    if stored_format != CODEC_FORMATS[codec.value]:
        raise UserError(f"{meta_path}: store holds {codec.value} blocks in format {stored_format}, this tiercache "
                        f"reads format {CODEC_FORMATS[codec.value]} ({codec.value}'s block layout changed); open it with "
                        "the tiercache that wrote it, or give the tier another directory")
    _check_geometry(meta_path, meta, shape, chunk_geometry(layout, codec))
    if capacity is not None and capacity != shape[0]:
        raise UserError(f"{meta_path}: store capacity is {shape[0]} blocks, asked for {capacity}")
    return shape[0]


def _check_geometry(meta_path: str, meta: dict, shape: tuple[int, ...], geometry: tuple[tuple[int, ...], str, int]) -> None:
    """The array must be ``[capacity >= 1, *block]`` in one-block chunks of the block's
    storage dtype (``chunk_geometry``), else the chunk files are not what the hot path reads."""
    block, dtype, _ = geometry
    if len(shape) != 1 + len(block) or shape[1:] != block or shape[0] < 1:
        raise UserError(f"{meta_path}: array shape {list(shape)} is not [capacity >= 1, *{list(block)}]")
    chunks = _chunk_shape(meta)
    if chunks != [1, *block]:
        raise UserError(f"{meta_path}: chunk shape {chunks!r} is not one block {[1, *block]}")
    if meta.get("data_type") != dtype:
        raise UserError(f"{meta_path}: data type {meta.get('data_type')!r}, the layout stores {dtype!r}")


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


def write_chunk_file(tmp_path: str, final_path: str, payload: np.ndarray) -> int:
    """Writes a chunk durably and atomically: temp file, fdatasync, rename over the chunk.

    The rename itself is made durable later by ``fsync_dir`` (batched at index flush).
    On any OSError the temp file is removed and the error re-raised; the chunk path then
    still holds whatever it held before.

    Returns:
        The crc32c of ``payload`` (the chunk is ``payload.size + 4`` bytes).
    """
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        try:
            crc = _write_sealed(fd, payload)
            os.fdatasync(fd)
            _drop_written(fd)
        finally:
            os.close(fd)
        os.replace(tmp_path, final_path)
    except OSError:
        unlink_quietly(tmp_path)
        raise
    return crc


def overwrite_chunk_file(path: str, payload: np.ndarray, crc_first: bool = True) -> int | None:
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
    writeback overlapping the crc (``_write_sealed``).

    Returns:
        The crc32c of ``payload``, or None (nothing written) when the file is absent or
        has another length.
    """
    try:  # O_NOFOLLOW: never write through a symlink to a file outside the store
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
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


def unlink_quietly(path: str) -> None:
    """Removes a file, if it is there (best effort)."""
    try:
        os.unlink(path)
    except OSError:
        pass  # already gone, or the disk is failing: reopen sweeps leftovers


def open_for_read(path: str, direct: bool) -> tuple[int, bool]:
    """Opens a file for reading, with O_DIRECT when asked and the filesystem allows it.

    Returns:
        ``(fd, direct)`` where ``direct`` says whether O_DIRECT is in effect.
    """
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: the filesystem refuses O_DIRECT (tmpfs)
                raise
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC), False


def supports_direct(path: str) -> bool:
    """True when the filesystem holding ``path`` (an existing file) accepts O_DIRECT."""
    fd, direct = open_for_read(path, True)
    os.close(fd)
    return direct


def read_chunk_file(path: str, buffers: list, direct: bool) -> tuple[int, bool]:
    """Reads a chunk file into ``buffers`` with one preadv from offset 0.

    With O_DIRECT every buffer must be page aligned in address and length; a chunk file is
    shorter than the buffers, and the read simply stops at end of file.

    Returns:
        ``(bytes read, whether O_DIRECT was used)``.
    """
    fd, used_direct = open_for_read(path, direct)
    try:
        return os.preadv(fd, buffers, 0), used_direct
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Makes renames and unlinks inside directory ``path`` durable."""
    fsync_path(path, os.O_DIRECTORY)


def fsync_path(path: str, flags: int = os.O_NOFOLLOW) -> None:
    """Makes a file durable (no symlink; the caller fsyncs its directory), or a directory's entries."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: str, data: bytes) -> None:
    """Writes a small file and fsyncs it (the caller fsyncs the directory)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_file_cache(path: str) -> None:
    """Evicts one file's clean pages from the page cache (never the system-wide cache)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
