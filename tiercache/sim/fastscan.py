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
"""

from __future__ import annotations

import numpy as np

from tiercache.policies.kernels import HAVE_NUMBA, njit

from .traces import MAX_TOKENS, FlatTrace, first_long_line

__all__ = ["scan_requests"]

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
    its ``]``, the new count), or (-1, count) when it is not a plain list that fits."""
    n = len(buf)
    if pos >= n or buf[pos] != _LBRACKET:
        return -1, count
    pos = _skip_inline(buf, pos + 1)
    if pos < n and buf[pos] == _RBRACKET:
        return pos + 1, count
    while True:
        if count >= len(ids):
            return -1, count
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
def _scan(buf, k0, k1, k2, k3, ids, lengths, meta):
    """(records, ids) written, or (-1, 0) when the bytes are not in the plain form."""
    n = len(buf)
    pos = 0
    r = 0
    count = 0
    while True:
        while pos < n and (buf[pos] == _SPACE or buf[pos] == _TAB or buf[pos] == _CR or buf[pos] == _LF):
            pos += 1
        if pos >= n:
            return r, count
        if buf[pos] != _LBRACE or r >= len(lengths):
            return -1, 0
        pos += 1
        seen = 0
        first = count
        while True:
            pos = _skip_inline(buf, pos)
            if pos >= n or buf[pos] != _QUOTE:
                return -1, 0
            column, pos = _key(buf, pos + 1, k0, k1, k2, k3)
            if column < 0 or seen & (1 << column):
                return -1, 0
            seen |= 1 << column
            pos = _skip_inline(buf, pos)
            if pos >= n or buf[pos] != _COLON:
                return -1, 0
            pos = _skip_inline(buf, pos + 1)
            if column < 3:
                pos = _uint(buf, pos, meta[r], column)
            else:
                pos, count = _id_list(buf, pos, ids, count)
            if pos < 0:
                return -1, 0
            pos = _skip_inline(buf, pos)
            if pos < n and buf[pos] == _COMMA:
                pos += 1
                continue
            if pos < n and buf[pos] == _RBRACE:
                pos += 1
                break
            return -1, 0
        if seen != 15:
            return -1, 0
        lengths[r] = count - first
        r += 1
        pos = _skip_inline(buf, pos)
        if pos < n and buf[pos] != _LF:
            return -1, 0  # one object per line


def scan_requests(data: bytes) -> FlatTrace | None:
    """The flat arrays of a trace in the plain form (see the module docstring), or None."""
    if not HAVE_NUMBA or not data or first_long_line(data) is not None:
        return None
    buf = np.frombuffer(data, dtype=np.uint8)
    records_cap, ids_cap = _capacities(data)
    ids = np.empty(ids_cap, dtype=np.int64)
    lengths = np.empty(records_cap, dtype=np.int64)
    meta = np.empty((records_cap, 3), dtype=np.int64)
    records, count = _scan(buf, _KEY0, _KEY1, _KEY2, _KEY3, ids, lengths, meta)
    if records <= 0 or int(meta[:records, 1:].max()) > MAX_TOKENS:
        return None  # not the plain form, or a token count the line reader refuses
    offsets = np.zeros(records, dtype=np.int64)
    np.cumsum(lengths[: records - 1], out=offsets[1:])
    return FlatTrace(ids[:count].copy(), offsets, meta[:records, 0].copy(), meta[:records, 1].copy(),
                     meta[:records, 2].copy())


#: Up to this size the output arrays are sized from the byte count alone (untouched pages
#: cost no memory); beyond it the bytes are counted, so the reservation stays near the need.
_SIZE_BOUND_BYTES = 256 << 20


def _capacities(data: bytes) -> tuple[int, int]:
    """Upper bounds of (records, ids) in ``data``: an id takes at least two bytes (a digit and
    a separator) and a record at least 16 (``{"hash_ids":[]}`` plus its line break; a plain
    record has four keys); a scan that would pass either falls back to the parsers, it never
    writes past them."""
    if len(data) <= _SIZE_BOUND_BYTES:
        return len(data) // 16 + 1, len(data) // 2 + 1
    records = data.count(b"{") + 1
    return records, data.count(b",") + records
