"""A compiled scanner for the plain form of Mooncake request lines, in front of the JSON parsers.

Real Mooncake traces (and ``write_requests``) hold one object per line with exactly the four
fields ``timestamp``, ``input_length``, ``output_length`` (non-negative integers) and
``hash_ids`` (a list of them), in any order, with any JSON whitespace. ``scan_requests``
reads that subset of JSON straight into arrays in one compiled pass (no Python object per
id), and gives up, returning None, on anything else: another field, a repeated key, a
string value, a float, a sign, a leading zero, a value of 2**63 or more, a token count over
``MAX_TOKENS``, a line over ``MAX_LINE_BYTES``, an escape, an object over two lines.
``load_trace`` then parses with orjson (``bulkparse``), and that in turn defers to the
validating line reader, which names the file, line and field of any error. So the three
paths accept the same traces and build the same arrays; the tests compare them on random
traces with random whitespace and key order.

``scan_into`` scans one window of a file's lines into ``FlatColumns``, arrays that grow as
windows are appended (``bulkparse.load_requests``: memory holds the arrays and one window);
nothing the scanner checks spans two lines, so where a window is cut changes no verdict.
"""

from __future__ import annotations

import numpy as np

from tiercache.policies.kernels import HAVE_NUMBA, njit

from . import tracelines
from .traces import MAX_TOKENS, FlatTrace

__all__ = ["scan_requests", "scan_into", "capacities", "FlatColumns"]

_INT64_MAX = (1 << 63) - 1
# The four keys, as byte codes, and their column (3: hash_ids).
_KEYS = [np.frombuffer(k, dtype=np.uint8).copy() for k in (b"timestamp", b"input_length", b"output_length", b"hash_ids")]
_KEY0, _KEY1, _KEY2, _KEY3 = _KEYS
_SPACE, _TAB, _CR, _LF = 32, 9, 13, 10
_QUOTE, _COLON, _COMMA, _LBRACE, _RBRACE, _LBRACKET, _RBRACKET = 34, 58, 44, 123, 125, 91, 93
_ZERO, _NINE = 48, 57


@njit
def _skip_inline(buf, pos):
    """Skips spaces, tabs and carriage returns (JSON whitespace within one line)."""
    n = len(buf)
    while pos < n and (buf[pos] == _SPACE or buf[pos] == _TAB or buf[pos] == _CR):
        pos += 1
    return pos


@njit
def _uint(buf, pos, out, k):
    """Parses a JSON non-negative integer at ``pos`` into ``out[k]``; the next position, or -1."""
    n = len(buf)
    if pos >= n or buf[pos] < _ZERO or buf[pos] > _NINE:
        return -1
    if buf[pos] == _ZERO and pos + 1 < n and _ZERO <= buf[pos + 1] <= _NINE:
        return -1  # a leading zero is not JSON
    start = pos
    value = np.int64(0)
    while pos < n and _ZERO <= buf[pos] <= _NINE:
        value = value * 10 + (np.int64(buf[pos]) - _ZERO)
        pos += 1
    if pos - start >= 19 and not _fits_int64(buf, start, pos):
        return -1  # 2**63 or more (up to 18 digits always fit: no check per digit)
    if pos < n and (buf[pos] == 46 or buf[pos] == 101 or buf[pos] == 69):
        return -1  # '.', 'e', 'E': a float
    out[k] = value
    return pos


@njit
def _fits_int64(buf, start, end):
    """Whether the digits ``buf[start:end]`` (no leading zero) are below 2**63."""
    value = np.int64(0)
    for pos in range(start, end):
        digit = np.int64(buf[pos]) - _ZERO
        if value > (_INT64_MAX - digit) // 10:
            return False
        value = value * 10 + digit
    return True


@njit
def _key(buf, pos, k0, k1, k2, k3):
    """Matches a quoted key at ``pos``; (column, position after the quote), column -1 if unknown."""
    n = len(buf)
    start = pos
    while pos < n and buf[pos] != _QUOTE:
        if buf[pos] == 92 or buf[pos] == _LF:  # an escape, or a line break inside a string
            return -1, pos
        pos += 1
    if pos >= n:
        return -1, pos
    length = pos - start
    for column in range(4):
        key = k0 if column == 0 else (k1 if column == 1 else (k2 if column == 2 else k3))
        if len(key) == length:
            same = True
            for i in range(length):
                if buf[start + i] != key[i]:
                    same = False
                    break
            if same:
                return column, pos + 1
    return -1, pos


@njit
def _id_list(buf, pos, ids, count):
    """Parses the JSON list of integers at ``pos`` into ``ids[count:]``; (the position after
    its ``]``, the new count), (-1, count) when it is not a plain list, (-2, count) when
    ``ids`` is full."""
    n = len(buf)
    if pos >= n or buf[pos] != _LBRACKET:
        return -1, count
    pos = _skip_inline(buf, pos + 1)
    if pos < n and buf[pos] == _RBRACKET:
        return pos + 1, count
    while True:
        if count >= len(ids):
            return -2, count
        pos = _uint(buf, pos, ids, count)
        if pos < 0:
            return -1, count
        count += 1
        pos = _skip_inline(buf, pos)
        if pos < n and buf[pos] == _COMMA:
            pos = _skip_inline(buf, pos + 1)
        elif pos < n and buf[pos] == _RBRACKET:
            return pos + 1, count
        else:
            return -1, count


@njit
def _record(buf, pos, k0, k1, k2, k3, ids, count, stamps, inputs, outputs, r):
    """Parses the object whose ``{`` is at ``pos`` as record ``r`` (its ids from ``ids[count]``
    on); (the position after its ``}``, the new count), or (-1, count) when it is not a plain
    record, (-2, count) when ``ids`` is full."""
    n = len(buf)
    pos += 1
    seen = 0
    while True:
        pos = _skip_inline(buf, pos)
        if pos >= n or buf[pos] != _QUOTE:
            return -1, count
        column, pos = _key(buf, pos + 1, k0, k1, k2, k3)
        if column < 0 or seen & (1 << column):
            return -1, count
        seen |= 1 << column
        pos = _skip_inline(buf, pos)
        if pos >= n or buf[pos] != _COLON:
            return -1, count
        pos = _skip_inline(buf, pos + 1)
        if column < 3:
            pos = _uint(buf, pos, stamps if column == 0 else (inputs if column == 1 else outputs), r)
        else:
            pos, count = _id_list(buf, pos, ids, count)
        if pos < 0:
            return pos, count
        pos = _skip_inline(buf, pos)
        if pos < n and buf[pos] == _COMMA:
            pos += 1
        elif pos < n and buf[pos] == _RBRACE:
            return (pos + 1, count) if seen == 15 else (-1, count)
        else:
            return -1, count


@njit
def _scan(buf, limit, k0, k1, k2, k3, ids, lengths, stamps, inputs, outputs):
    """(records, ids) written, (-1, 0) when the bytes are not in the plain form (a line over
    ``limit`` bytes, its break included, among them: the line reader refuses it), or (-2, 0)
    when ``ids`` or the per-record arrays are full.

    Record ``r`` gets ``lengths[r]`` (its id count) and its three fields; its ids follow the
    previous record's in ``ids``."""
    n = len(buf)
    pos = 0
    r = 0
    count = 0
    line_start = 0
    while True:
        while pos < n and (buf[pos] == _SPACE or buf[pos] == _TAB or buf[pos] == _CR or buf[pos] == _LF):
            if buf[pos] == _LF:
                if pos + 1 - line_start > limit:
                    return -1, 0
                line_start = pos + 1
            pos += 1
        if pos >= n:
            return (r, count) if n - line_start <= limit else (-1, 0)
        if buf[pos] != _LBRACE:
            return -1, 0
        if r >= len(lengths):
            return -2, 0
        first = count
        pos, count = _record(buf, pos, k0, k1, k2, k3, ids, count, stamps, inputs, outputs, r)
        if pos < 0:
            return pos, 0
        lengths[r] = count - first
        r += 1
        pos = _skip_inline(buf, pos)
        if pos < n and buf[pos] != _LF:
            return -1, 0  # one object per line


def scan_requests(data: bytes) -> FlatTrace | None:
    """The flat arrays of a whole trace's bytes in the plain form (see the module docstring),
    or None."""
    if not HAVE_NUMBA or not data:
        return None
    columns = FlatColumns(*capacities(data, len(data), len(data)))
    if not scan_into(columns, data, len(data)) or not columns.records:
        return None
    return columns.finish()


def scan_into(columns: FlatColumns, data, end: int) -> bool:
    """Appends the records of ``data[:end]`` (bytes or a bytearray; whole lines) to ``columns``
    when all of it is in the plain form; False, ``columns`` unchanged, when not (or without
    numba): then the orjson parser (``bulkparse``) reads them, or defers.

    The scan writes straight into the columns' free room; when that runs out the columns
    grow by the most this many bytes can hold (an id takes at least two bytes, a digit and a
    separator; a plain record far more than 16) and the scan starts over, so each call
    grows them at most once.
    """
    if not HAVE_NUMBA:
        return False
    if end == 0:
        return True
    buf = np.frombuffer(data, dtype=np.uint8, count=end)
    while True:
        ids, lengths, stamps, inputs, outputs = columns.free()
        records, count = _scan(buf, tracelines.MAX_LINE_BYTES, _KEY0, _KEY1, _KEY2, _KEY3, ids, lengths, stamps,
                               inputs, outputs)
        if records != -2:
            break
        columns.reserve(end // 2 + 1, end // 16 + 1)
    if records < 0 or (records and max(int(inputs[:records].max()), int(outputs[:records].max())) > MAX_TOKENS):
        return False  # not the plain form, or a token count the line reader refuses
    columns.commit(records, count)
    return True


#: The shortest line a record can be (``{"hash_ids":[]}`` and a line break).
MIN_RECORD_BYTES = 16


def capacities(data, end: int, size: int) -> tuple[int, int]:
    """Estimates of the (ids, records) of a trace of ``size`` bytes whose first ``end`` bytes
    are ``data[:end]``: whole lines hold at most one record per line and one id per comma or
    line (a record's ``k`` ids have ``k - 1`` commas between them). Upper bounds when
    ``end == size``; else those counts scaled by ``size / end``, an eighth to spare: a guess
    (``FlatColumns`` grows when it falls short), at most what ``size`` bytes can hold: an
    id takes a digit and a separator, a record line at least ``{"hash_ids":[]}`` and its
    line break (a sample whose strings hold many commas would ask for far more)."""
    lines = data.count(b"\n", 0, end) + 1
    scale = 1.0 if end >= size else size / max(end, 1) * 1.125
    ids = int((data.count(b",", 0, end) + lines) * scale) + 1
    return min(ids, size // 2 + 1), min(int(lines * scale) + 1, size // MIN_RECORD_BYTES + 1)


class FlatColumns:
    """The arrays of a request trace being read, grown as records are appended in file order.

    Invariants: ``ids[:count]`` holds the ids of the ``records`` records appended so far;
    ``bounds[0] == 0`` and ``bounds[1 + r]`` is record ``r``'s id count; ``stamps``,
    ``inputs`` and ``outputs`` hold their fields in ``[:records]``; ``len(bounds)`` is always
    ``len(stamps) + 1``, so the record views ``free`` gives are of one length. Past that each array has
    uninitialised room, allocated by ``np.empty`` and so taking no memory until written. A
    full array grows by half (or to what is asked): one copy of what it holds. No view of
    the arrays outlives the call that takes it (``free``'s are written and dropped), since
    ``finish`` trims them in place.
    """

    def __init__(self, ids: int, records: int) -> None:
        self.ids = np.empty(max(ids, 1), dtype=np.int64)
        self.bounds = np.empty(max(records, 1) + 1, dtype=np.int64)
        self.bounds[0] = 0
        self.stamps, self.inputs, self.outputs = (np.empty(max(records, 1), dtype=np.int64) for _ in range(3))
        self.count = 0
        self.records = 0

    def reserve(self, ids: int, records: int) -> None:
        """Makes room for ``ids`` more ids and ``records`` more records."""
        if self.count + ids > len(self.ids):
            self.ids = _grown(self.ids, self.count, self.count + ids)
        need = self.records + records
        if need > len(self.stamps):
            self.stamps, self.inputs, self.outputs = (_grown(a, self.records, need)
                                                      for a in (self.stamps, self.inputs, self.outputs))
            # Exactly one more slot than the record arrays (the id counts start at bounds[1]):
            # the compiled scanner bounds-checks the id-count view only, and writes the other
            # three at the same record index unchecked.
            self.bounds = _resized(self.bounds, self.records + 1, len(self.stamps) + 1)

    def free(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Views of the room past what is held: (ids, id counts, timestamps, input lengths,
        output lengths), for the next records; ``commit`` then counts what was written."""
        r = self.records
        rows = len(self.stamps)  # every record view ends here, the id counts' too
        return (self.ids[self.count:], self.bounds[r + 1:rows + 1], self.stamps[r:rows], self.inputs[r:rows],
                self.outputs[r:rows])

    def commit(self, records: int, ids: int) -> None:
        """Counts ``records`` records and their ``ids`` ids written into ``free()``'s views."""
        self.records += records
        self.count += ids

    def append(self, ids: np.ndarray, lengths: np.ndarray, stamps: np.ndarray, inputs: np.ndarray,
               outputs: np.ndarray) -> None:
        """Appends records: their ids, and per record its id count and three fields."""
        self.reserve(len(ids), len(lengths))
        for room, values in zip(self.free(), (ids, lengths, stamps, inputs, outputs)):
            room[: len(values)] = values
        self.commit(len(lengths), len(ids))

    def finish(self) -> FlatTrace:
        """The flat trace of what was appended. The arrays are trimmed in place
        (``ndarray.resize``: a ``realloc``, which shrinks a large block where it lies) and
        the counts become offsets in place: no copy of the ids. The columns are spent."""
        n = self.records
        self.ids.resize(self.count, refcheck=False)
        offsets = self.bounds
        offsets.resize(n + 1, refcheck=False)
        np.cumsum(offsets, out=offsets)
        offsets.resize(n, refcheck=False)
        for column in (self.stamps, self.inputs, self.outputs):
            column.resize(n, refcheck=False)
        return FlatTrace(self.ids, offsets, self.stamps, self.inputs, self.outputs)


def _grown(array: np.ndarray, used: int, need: int) -> np.ndarray:
    """A larger copy of ``array`` (its first ``used`` entries; the rest uninitialised): room
    for ``need`` entries, and at least half again its length (amortised growth)."""
    return _resized(array, used, max(need, len(array) + len(array) // 2))


def _resized(array: np.ndarray, used: int, size: int) -> np.ndarray:
    """A copy of ``array``'s first ``used`` entries in an array of ``size`` (the rest uninitialised)."""
    grown = np.empty(size, dtype=array.dtype)
    grown[:used] = array[:used]
    return grown
