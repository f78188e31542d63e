"""A fast path for reading a whole Mooncake request trace: one orjson call per chunk of lines.

``bulk_requests(data)`` parses the file's bytes as one JSON array per ~1 MiB chunk, pulls the
fields out with C-level list operations and checks every type and range in bulk (one pass
over all ids). It returns None as soon as anything is unusual (a non-object line, a missing
field, a non-integer, a negative or too large value, a token count over ``MAX_TOKENS``, a
line over ``MAX_LINE_BYTES``, a record whose format is not the first one's, malformed
JSON, a line that is not exactly one record, a record that may repeat a key): the caller
then reads the file with the validating line-by-line reader, which names the file, line
and field of the error. So both paths accept exactly the same traces and build the same
arrays (tested).
"""

from __future__ import annotations

import gc
import itertools
import re
from operator import itemgetter

import numpy as np
import orjson

from .tracelines import keys_spelled_once
from .traces import MAX_TOKENS, FlatTrace, first_long_line, request_format

__all__ = ["bulk_requests", "MAX_BULK_BYTES"]

#: Larger files are read by the streaming reader (bounded memory).
MAX_BULK_BYTES = 1 << 30
_CHUNK_BYTES = 1 << 20
_META = itemgetter("timestamp", "input_length", "output_length")
_INT64_MAX = (1 << 63) - 1
#: A comma right after an object's ``}`` (JSON whitespace between, no line break): where two
#: records could sit on one line.
_COMMA_AFTER_OBJECT = re.compile(rb"\}[ \t\r]*,")


def bulk_requests(data: bytes, seconds: bool = False) -> FlatTrace | None:
    """The flat arrays of a request trace's bytes, or None to defer to the line reader.

    With ``seconds`` (a Bailian trace, ``traces.request_format``) timestamps may be floats, in
    seconds, and become milliseconds rounded to nearest, as the line reader converts them.

    The cyclic garbage collector is paused meanwhile: the parse makes one dict and one list
    per request and no cycles, and collections triggered by those allocations made a 10x
    larger trace take 16x longer to load.
    """
    if first_long_line(data) is not None:
        return None  # the line reader names the line that is too long
    paused = gc.isenabled()
    gc.disable()
    try:
        return _bulk_requests(data, seconds)
    finally:
        if paused:
            gc.enable()


def _bulk_requests(data: bytes, seconds: bool) -> FlatTrace | None:
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    start = 0
    while start < len(data):
        cut = data.find(b"\n", start + _CHUNK_BYTES)
        end = len(data) if cut < 0 else cut + 1
        part = _chunk(data[start:end], seconds)
        start = end
        if part is None:
            return None
        if len(part[1]):
            parts.append(part)
    if not parts:
        return None  # no records: the line reader says the trace is empty
    ids = np.concatenate([p[0] for p in parts])
    lengths = np.concatenate([p[1] for p in parts])
    cols = np.concatenate([p[2] for p in parts])
    offsets = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    return FlatTrace(ids, offsets, cols[:, 0].copy(), cols[:, 1].copy(), cols[:, 2].copy())


def _chunk(text: bytes, seconds: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(ids, ids per request, [timestamp, input, output] per request) of whole lines, or None.

    Chunks are converted to arrays one at a time, so the Python objects of only one chunk
    (about 1 MiB of text) exist at once: memory stays near the arrays' 8 B per id. The
    lines must hold one record each (``_one_record_per_line``) and no record may repeat a
    key (``keys_spelled_once``), as the line reader requires.
    """
    parsed = _parse_lines(text)
    if parsed is None:
        return None
    objects, records = parsed
    if len(objects) != records or set(map(type, objects)) != {dict}:
        return None
    quotes = text.count(b'"')
    if not _one_record_per_line(text) or not keys_spelled_once(text, objects, quotes):
        return None
    escaped = b"\\" in text  # an escape spells a key or a value in other bytes: no byte-count shortcut holds
    if not _one_format(objects, text, seconds, escaped):
        return None
    try:
        id_lists = list(map(itemgetter("hash_ids"), objects))
        meta = list(map(_META, objects))
    except KeyError:
        return None
    if seconds:
        stamps = _milliseconds([m[0] for m in meta])
        if stamps is None:
            return None
        meta = [(ms, m[1], m[2]) for ms, m in zip(stamps, meta)]
    return _arrays(id_lists, meta, _only_the_four_integer_fields(text, records, quotes, escaped))


def _parse_lines(text: bytes) -> tuple[list, int] | None:
    """(the JSON values of the non-blank lines of ``text``, parsed as one array, and how many
    such lines there are), or None when that array is not valid JSON.

    Without blank lines the newlines simply become the array's commas (a blank line would
    make ``,,``, which fails: then the non-blank lines are joined instead, a rarer and
    slower case). A line break inside a record reads as a comma too: the caller checks.
    """
    body = text.rstrip(b"\n")
    try:
        return orjson.loads(b"[" + body.replace(b"\n", b",") + b"]"), body.count(b"\n") + 1
    except orjson.JSONDecodeError:
        pass
    lines = [line for line in text.split(b"\n") if line.strip()]
    try:
        return orjson.loads(b"[" + b",".join(lines) + b"]"), len(lines)
    except orjson.JSONDecodeError:
        return None


def _one_record_per_line(text: bytes) -> bool:
    """Whether the non-blank lines of ``text``, parsed joined by commas into as many objects
    as there are lines (``_parse_lines``), each hold exactly one of them (as the line reader
    requires).

    The parsed array's ``records - 1`` separators follow an object's ``}`` (JSON whitespace
    between, no line break: a line break became a comma). With no such comma in the text,
    every separator is a joining comma, and there are only ``records - 1`` of those, so no
    line break sits inside a record and no line holds two: a line ``{...}, {..."hash_ids": [1``
    followed by ``4]}`` is rejected here, although its object count matches. One regular
    expression scan, which ``}`` (once per record) makes fast.
    """
    return _COMMA_AFTER_OBJECT.search(text) is None


def _is_bailian(record: dict) -> bool:
    return request_format(record) == "bailian"


def _one_format(objects: list[dict], text: bytes, seconds: bool, escaped: bool) -> bool:
    """Whether every record has the trace's format (``traces.request_format``): all Bailian
    records for a Bailian trace (``seconds``), none for a Mooncake one.

    For a Mooncake trace a byte search comes first, so it pays one scan of its bytes: with
    no escape in ``text`` (``escaped`` False) a record can hold the key ``parent_chat_id``
    only spelled as those bytes, so their absence proves no record is Bailian. With an
    escape (``"parent\\u005fchat_id"``) every record is checked.
    """
    if seconds:
        return all(map(_is_bailian, objects))
    if not escaped and b'"parent_chat_id"' not in text:
        return True
    return not any(map(_is_bailian, objects))


#: Larger timestamps (in seconds) go to the line reader, which converts them exactly.
_MAX_BULK_SECONDS = 1e12


def _milliseconds(stamps: list) -> list[int] | None:
    """Seconds (ints or floats) as integer milliseconds rounded to nearest, or None on
    anything else (bools, strings, negatives, NaN, very large values)."""
    if stamps and not set(map(type, stamps)) <= {int, float}:
        return None
    values = np.array(stamps, dtype=np.float64)
    if len(values) and not (np.all(values >= 0) and float(values.max()) < _MAX_BULK_SECONDS):
        return None
    return np.rint(values * 1000).astype(np.int64).tolist()


def _only_the_four_integer_fields(data: bytes, records: int, quotes: int, escaped: bool) -> bool:
    """True when the bytes can hold nothing but integers besides the four keys.

    Never with an escape in ``data`` (``escaped``, the caller's ``b"\\\\" in data``).
    Without one, each record's keys are spelled as their bytes, with 8 double quotes and 3
    letters ``e`` (``timestamp``, ``input_length``, ``output_length``): with exactly that
    many, no record has another field or a string value, and no value is ``true``/``false``
    or a float (a float needs a ``.``, an ``e`` or an ``E``). An escaped key
    (``tim\\u0065stamp``) would spell one ``e`` fewer and let a ``true`` or ``25e-1`` balance
    the count. Byte counts run at memory speed (``quotes``, the count of double quotes, is
    the caller's); when this holds the ids go straight into numpy without a Python type
    check per id.
    """
    return (not escaped and quotes == 8 * records and data.count(b"e") == 3 * records and b"E" not in data
            and b"." not in data)


def _arrays(id_lists: list, meta: list[tuple], plain: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Checks types and ranges in bulk and builds the arrays; None on anything unusual."""
    if set(map(type, id_lists)) != {list}:
        return None
    try:
        if plain:  # only ints can be there (or nulls, nested lists: numpy refuses those)
            ids = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int64)
        else:
            flat = list(itertools.chain.from_iterable(id_lists))
            if flat and set(map(type, flat)) != {int}:
                return None  # bools, floats, strings, nulls: the line reader says which and where
            ids = np.array(flat, dtype=np.int64)
        scalars = list(itertools.chain.from_iterable(meta))
        if set(map(type, scalars)) != {int}:
            return None
        cols = np.array(scalars, dtype=np.int64).reshape(len(meta), 3)
    except (OverflowError, TypeError, ValueError):
        return None  # a value of 2**63 or more, or something numpy cannot take as an int
    if (len(ids) and int(ids.min()) < 0) or int(cols.min()) < 0 or int(cols[:, 1:].max()) > MAX_TOKENS:
        return None
    lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    return ids, lengths, cols
