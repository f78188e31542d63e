"""A fast path for reading a whole Mooncake request trace: one orjson call per chunk of lines.

``bulk_requests(name, data)`` parses the file's bytes as one JSON array per chunk, pulls the
fields out with C-level list operations and checks every type and range in bulk (one pass
over all ids). It returns None as soon as anything is unusual (a non-object line, a missing
field, a non-integer, a negative or too large value, malformed JSON): the caller then reads
the file with the validating line-by-line reader, which names the file, line and field of
the error. So both paths accept exactly the same traces and build the same arrays (tested).
"""

from __future__ import annotations

import itertools
from operator import itemgetter

import numpy as np
import orjson

from .traces import FlatTrace

__all__ = ["bulk_requests", "MAX_BULK_BYTES"]

#: Larger files are read by the streaming reader (bounded memory).
MAX_BULK_BYTES = 1 << 30
_CHUNK_LINES = 1 << 16
_META = itemgetter("timestamp", "input_length", "output_length")
_INT64_MAX = (1 << 63) - 1


def bulk_requests(data: bytes) -> FlatTrace | None:
    """The flat arrays of a request trace's bytes, or None to defer to the line reader."""
    lines = [line for line in data.split(b"\n") if line.strip()]
    if not lines:
        return None
    id_lists: list[list] = []
    meta: list[tuple] = []
    for start in range(0, len(lines), _CHUNK_LINES):
        try:
            objects = orjson.loads(b"[" + b",".join(lines[start : start + _CHUNK_LINES]) + b"]")
        except orjson.JSONDecodeError:
            return None
        if set(map(type, objects)) != {dict}:
            return None
        try:
            id_lists.extend(map(itemgetter("hash_ids"), objects))
            meta.extend(map(_META, objects))
        except KeyError:
            return None
    return _arrays(id_lists, meta)


def _arrays(id_lists: list[list], meta: list[tuple]) -> FlatTrace | None:
    """Checks types and ranges in bulk and builds the arrays; None on anything unusual."""
    if set(map(type, id_lists)) != {list}:
        return None
    flat = list(itertools.chain.from_iterable(id_lists))
    scalars = list(itertools.chain.from_iterable(meta))
    if (flat and set(map(type, flat)) != {int}) or set(map(type, scalars)) != {int}:
        return None  # bools, floats, strings, nulls: the line reader says which and where
    try:
        ids = np.array(flat, dtype=np.int64)
        cols = np.array(scalars, dtype=np.int64).reshape(len(meta), 3)
    except OverflowError:
        return None  # a value of 2**63 or more
    if (len(ids) and int(ids.min()) < 0) or int(cols.min()) < 0:
        return None
    lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    offsets = np.zeros(len(meta), dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    return FlatTrace(ids, offsets, cols[:, 0].copy(), cols[:, 1].copy(), cols[:, 2].copy())
