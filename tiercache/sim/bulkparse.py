"""A fast path for reading a Mooncake request trace: windows of lines, one orjson call per chunk.

``load_requests`` reads a request trace one window of whole lines at a time (``WINDOW_BYTES``,
cut at a line break), parses each with the compiled scanner (``fastscan``, the plain form)
or else a ~1 MiB chunk of lines at a time, each with the scanner or else with orjson, and appends the records to growing arrays (``fastscan.FlatColumns``):
memory holds the arrays and one window, whatever the file's size; the fingerprint digest is
updated as the bytes are read. ``bulk_requests(data)`` parses bytes held whole the same way.
The orjson path parses one JSON array per ~1 MiB chunk, pulls the fields out with C-level
list operations and checks every type and range in bulk (one pass over all ids). Both give
up (False, None) as soon as anything is unusual (a non-object line, a missing field, a
non-integer, a negative or too large value, a token count over ``MAX_TOKENS``, a line over
``MAX_LINE_BYTES``, a record whose format is not the first one's, malformed JSON, a line
that is not exactly one record, a record that may repeat a key): the caller then reads the
file with the validating line-by-line reader, which names the file, line and field of the
error. Every check concerns one line (counts over a chunk only decide whether to look
closer), so cutting windows and chunks at line breaks changes no verdict; the one thing a
record is checked against, the first record's format, ``load_requests`` reads first and
applies to every window. So both paths accept exactly the same traces and build the same
arrays (tested).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import re
from operator import itemgetter
from typing import BinaryIO, Iterator

import numpy as np
import orjson

from . import tracelines
from .fastscan import FlatColumns, capacities, scan_into
from .tracelines import keys_spelled_once
from .traces import MAX_TOKENS, FlatTrace, first_long_line, request_format

__all__ = ["bulk_requests", "load_requests", "WINDOW_BYTES"]

#: The bytes ``load_requests`` reads and parses at a time (a window grows only to hold a
#: line longer than it, up to ``MAX_LINE_BYTES``).
WINDOW_BYTES = 64 << 20
_CHUNK_BYTES = 1 << 20
#: The bytes of the first window whose ids and lines per byte size the arrays.
_SAMPLE_BYTES = 4 << 20
_META = itemgetter("timestamp", "input_length", "output_length")
#: A comma right after an object's ``}`` (JSON whitespace between, no line break): where two
#: records could sit on one line.
_COMMA_AFTER_OBJECT = re.compile(rb"\}[ \t\r]*,")


def load_requests(handle: BinaryIO, size: int, digest) -> tuple[FlatTrace, bool] | None:
    """The flat arrays of the request trace open in ``handle`` (read from its start; ``size``,
    its length in bytes, sizes the arrays and need not be exact), and whether it is a Bailian
    trace (``traces.request_format`` of its first line: seconds, 16-token blocks); or None
    to defer to the line reader: a first line that is not a request record (a step trace,
    among others), anything the parsers give up on, no records at all.

    ``digest`` (a ``fingerprint_digest``) is updated with every byte of the file, in order,
    when the arrays are returned. Peak memory is the arrays plus about one window: they grow
    in place, by half when an estimate from the first window falls short, and are trimmed at
    the end without a copy.

    Raises:
        OSError: the file could not be read.
    """
    with _gc_paused():
        parsed = _parse_windows(_line_windows(handle, size, digest), size)
    if parsed is None:
        return None
    columns, bailian = parsed
    return columns.finish(), bailian


def _parse_windows(windows: Iterator[tuple[bytearray, int] | None], size: int) -> tuple[FlatColumns, bool] | None:
    """The records of every window appended to new columns sized by the start of the first
    window (``_SAMPLE_BYTES`` of it), and the trace's format (``_first_line_format``); None as
    ``load_requests``."""
    columns = None
    bailian = False
    for window in windows:
        if window is None:
            return None  # a line over MAX_LINE_BYTES
        if columns is None:
            first = _first_line_format(*window)
            if first is None:
                return None
            columns, bailian = FlatColumns(*capacities(window[0], min(window[1], _SAMPLE_BYTES), size)), first
        if not _append_window(columns, *window, bailian):
            return None
    if columns is None or not columns.records:
        return None  # no records: the line reader says the trace is empty
    return columns, bailian


def _append_window(columns: FlatColumns, data: bytearray, end: int, bailian: bool) -> bool:
    """Appends the records of the window ``data[:end]`` (whole lines): the compiled scanner
    reads a plain window at once; a window it refuses is read a chunk of about
    ``_CHUNK_BYTES`` of lines at a time, each by the scanner when it can and by orjson when
    not, so one unusual record costs orjson one chunk, not the window. Bailian records go to
    orjson. False as ``bulk_into`` (``columns`` may then hold part of the records)."""
    if bailian:
        return bulk_into(columns, data, end, seconds=True)  # the compiled scanner reads no Bailian record
    if scan_into(columns, data, end):
        return True
    return all(scan_into(columns, chunk, len(chunk)) or bulk_into(columns, chunk, len(chunk))
               for chunk in _line_chunks(data, end))


def _line_chunks(data, end: int) -> Iterator[bytes]:
    """Copies of ``data[:end]`` (whole lines) in chunks of whole lines: each the first line
    break at or past ``_CHUNK_BYTES`` into it, or the rest."""
    start = 0
    with memoryview(data) as view:
        while start < end:
            cut = data.find(b"\n", start + _CHUNK_BYTES, end)
            stop = end if cut < 0 else cut + 1
            yield bytes(view[start:stop])
            start = stop


def _first_line_format(data: bytearray, end: int) -> bool | None:
    """Whether the trace whose first window is ``data[:end]`` is a Bailian trace, from its
    first line; None when that line is not a JSON object spelling ``"hash_ids"`` (the line
    reader then reads the trace, or names its error)."""
    cut = data.find(b"\n", 0, end)
    line = bytes(memoryview(data)[: end if cut < 0 else cut])
    if not line.lstrip().startswith(b"{") or b'"hash_ids"' not in line:
        return None
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return request_format(record) == "bailian" if isinstance(record, dict) else None


def _line_windows(handle: BinaryIO, size: int, digest) -> Iterator[tuple[bytearray, int] | None]:
    """Windows of the file open in ``handle``: ``(buffer, end)``, where ``buffer[:end]`` holds
    the next whole lines, line breaks included (the last line of the file may have none).

    One buffer of ``WINDOW_BYTES`` (at most the file's ``size`` plus one) is reused: a window
    must be used before the next is asked for. The partial line after a window's last line
    break moves to the buffer's start and the read goes on behind it; a buffer holding no
    line break grows to twice its size, or, when its bytes are already more than
    ``MAX_LINE_BYTES`` (the line reader refuses that line), None is yielded and nothing
    more. Each byte updates ``digest`` once, in file order, as it is read.
    """
    buf = bytearray(max(1, min(WINDOW_BYTES, size + 1)))
    fill = 0
    while True:
        end = fill + _read_into(handle, buf, fill)
        digest.update(memoryview(buf)[fill:end])
        if end < len(buf):  # the end of the file
            if end:
                yield buf, end
            return
        cut = buf.rfind(b"\n", 0, end) + 1
        if cut == 0:  # one line fills the buffer
            if end > tracelines.MAX_LINE_BYTES:
                yield None
                return
            grown = bytearray(2 * len(buf))
            grown[:end] = buf
            buf, fill = grown, end
            continue
        yield buf, cut
        buf[: end - cut] = buf[cut:end]
        fill = end - cut


def _read_into(handle: BinaryIO, buf: bytearray, start: int) -> int:
    """Reads into ``buf[start:]`` until it is full or the file ends; the bytes read."""
    total = start
    with memoryview(buf) as view:
        while total < len(buf):
            read = handle.readinto(view[total:])
            if not read:
                break
            total += read
    return total - start


def bulk_requests(data: bytes, seconds: bool = False) -> FlatTrace | None:
    """The flat arrays of a whole request trace's bytes, or None to defer to the line reader.

    With ``seconds`` (a Bailian trace, ``traces.request_format``) timestamps may be floats, in
    seconds, and become milliseconds rounded to nearest, as the line reader converts them.
    """
    with _gc_paused():
        columns = FlatColumns(*capacities(data, len(data), len(data)))
        if not bulk_into(columns, data, len(data), seconds) or not columns.records:
            return None
    return columns.finish()


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pauses the cyclic garbage collector: the parse makes one dict and one list per request
    and no cycles, and collections triggered by those allocations made a 10x larger trace
    take 16x longer to load."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def bulk_into(columns: FlatColumns, data, end: int, seconds: bool = False) -> bool:
    """Appends the records of ``data[:end]`` (bytes or a bytearray; whole lines) to ``columns``,
    parsed a chunk of about ``_CHUNK_BYTES`` of lines at a time, so the Python objects of only
    one chunk exist at once; False when a chunk is unusual (``_chunk``) or holds a line over
    ``MAX_LINE_BYTES`` (then ``columns`` may hold part of the records: the caller defers)."""
    for text in _line_chunks(data, end):
        if text.isspace():
            continue  # blank lines only: no records (the line reader skips them too)
        part = None if first_long_line(text) is not None else _chunk(text, seconds)
        if part is None:
            return False
        ids, lengths, cols = part
        columns.append(ids, lengths, cols[:, 0], cols[:, 1], cols[:, 2])
    return True


def _chunk(text: bytes, seconds: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(ids, ids per request, [timestamp, input, output] per request) of whole lines, or None.

    The lines must hold one record each (``_one_record_per_line``) and no record may repeat a
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
