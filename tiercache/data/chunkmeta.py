"""The NVMe store's metadata: its zarr v3 array (``zarr.json``) and the tiercache
attributes recorded in it, written at creation and checked at every reopen.

``tiercache.data.chunkio`` (the chunk files) re-exports these names; see its docstring for
the format as a whole.
"""

from __future__ import annotations

import errno
import json
import os
import uuid

import numpy as np

from ..config import CODEC_FORMATS, Codec, KVLayout
from ..errors import UserError

__all__ = ["FORMAT_VERSION", "ATTR_KEY", "COMPRESSIONS", "STORAGE_DTYPES", "chunk_geometry", "layout_attributes",
           "array_metadata", "create_array", "has_entry", "read_attributes", "check_store"]

FORMAT_VERSION = 1
META_NAME = "zarr.json"
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


def array_metadata(layout: KVLayout, capacity: int, compression: str | None, codec: Codec = Codec.NONE) -> bytes:
    """The ``zarr.json`` of a store's zarr v3 array, as zarr writes it (built in memory).

    Called once per store, off the hot path, so importing zarr here costs nothing later.
    """
    import zarr
    from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec

    block, dtype, _ = chunk_geometry(layout, codec)
    compressors = [Crc32cCodec()]
    if compression == "lz4":
        typesize = np.dtype(dtype).itemsize
        compressors.insert(0, BloscCodec(cname="lz4", clevel=5, shuffle="shuffle", typesize=typesize))
    files: dict = {}
    zarr.create_array(
        store=zarr.storage.MemoryStore(files),
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
    return files[META_NAME].to_bytes()


def create_array(path: str, layout: KVLayout, capacity: int, compression: str | None, codec: Codec = Codec.NONE,
                 dir_fd: int | None = None) -> None:
    """Creates the zarr v3 array (its ``zarr.json``) in the folder ``path`` durably and
    atomically (a temp file named as zarr names its own, fsynced, renamed, the folder
    fsynced); writes no chunk. With ``dir_fd`` (the folder held open) the file is that
    folder's, whatever ``path`` names meanwhile; without, the folder is made if missing.
    """
    from .chunkio import fsync_dir, replace_file, unlink_quietly, write_file_durably

    if dir_fd is None:
        os.makedirs(path, exist_ok=True)
    meta, tmp = os.path.join(path, META_NAME), os.path.join(path, f"zarr.{uuid.uuid4().hex}.partial")
    if os.path.lexists(meta) if dir_fd is None else has_entry(meta, dir_fd):
        raise FileExistsError(errno.EEXIST, "an array is there already (never replaced)", meta)
    try:
        write_file_durably(tmp, array_metadata(layout, capacity, compression, codec), dir_fd)
        replace_file(tmp, meta, dir_fd)
    except BaseException:
        unlink_quietly(tmp, dir_fd)
        raise
    fsync_dir(path, dir_fd)


def has_entry(path: str, dir_fd: int) -> bool:
    """True if the folder ``dir_fd`` holds open has an entry named as ``path``'s last part (a
    link counts); an OSError names ``path``."""
    try:
        os.stat(os.path.basename(path), dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    except OSError as exc:
        exc.filename = path
        raise
    return True


def read_attributes(path: str, dir_fd: int | None = None) -> tuple[tuple[int, ...], dict, dict]:
    """Reads an existing store's array shape, tiercache attributes and whole metadata (from
    the folder ``dir_fd`` holds open, when given).

    Raises:
        UserError: ``zarr.json`` unreadable, not a JSON object, not an array written by
            tiercache, or with a shape that is not a list of integers (names the file).
    """
    from .chunkio import read_small_file

    meta_path = os.path.join(path, META_NAME)
    try:
        meta = json.loads(read_small_file(meta_path, dir_fd).decode("utf-8"))
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
                codec: Codec = Codec.NONE, dir_fd: int | None = None) -> int:
    """Checks an existing store against what the caller asks for; returns its capacity.

    A store written before codecs were recorded holds plain blocks (codec ``none``); one
    written before models were recorded (``model``, ``KVLayout.name``) opens under any name.

    Raises:
        UserError: another format version, layout, model name, compression, codec, capacity, array
            shape, chunk shape or data type (the message names ``zarr.json`` and gives
            stored and asked values); ``dir_fd``: as ``read_attributes``.
    """
    shape, attrs, meta = read_attributes(path, dir_fd)
    meta_path = os.path.join(path, META_NAME)
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
