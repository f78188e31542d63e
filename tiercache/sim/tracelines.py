"""JSONL lines and the fields of a request record: the readers' shared checks.

Lines are streamed with a length bound (``MAX_LINE_BYTES``), parsed with orjson, and each
field checked for type and range; every error is a ``TraceError(path, line, message)``
naming the 1-based line. A record may not repeat a key (orjson would keep the last value
silently). Token counts are bounded (``MAX_TOKENS`` per request, ``MAX_TOTAL_TOKENS``
summed) so a replay's token sums stay inside int64. ``traces`` re-exports the public names.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import orjson

from tiercache.errors import TraceError

if TYPE_CHECKING:
    from .traces import FlatTrace

__all__ = ["MAX_LINE_BYTES", "MAX_TOKENS", "MAX_TOTAL_TOKENS", "iter_json_objects", "first_long_line", "int_field",
           "seconds_field_ms", "token_field", "id_list_field", "check_token_counts", "keys_spelled_once",
           "first_repeated_key", "record_line"]

_INT64_MAX = (1 << 63) - 1
#: The longest line a trace may have. A real record is kilobytes (a 4,096-block step record
#: about 80 KB); the bound keeps a file without newlines (``/dev/zero``) from being read
#: into memory whole.
MAX_LINE_BYTES = 64 << 20
#: The most tokens one request's ``input_length`` or ``output_length`` may give (2**40, about
#: 1.1e12: far beyond any context). With ``MAX_TOTAL_TOKENS`` it keeps every token sum of a
#: replay (prefill tokens, tokens saved) inside int64.
MAX_TOKENS = 1 << 40
#: The most input tokens a whole request trace may give (their sum is kept as an int64).
MAX_TOTAL_TOKENS = 1 << 62
_TOKEN_FIELDS = ("input_length", "output_length")
#: The error for a record nested deeper than a parser can follow (orjson's limit is 1024
#: levels, Python json's about 1000).
_TOO_DEEP = "malformed record: JSON nested too deeply"


def iter_json_objects(path: str | os.PathLike, digest: Any = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yields ``(line, object)`` for each non-blank line of a JSONL file, streamed.

    ``digest`` (a ``fingerprint_digest``), when given, is updated with every byte of the file
    (blank lines included), so a reader that runs to the end also has the file's digest.

    Raises:
        TraceError: the file cannot be opened (missing, a directory, unreadable), a line is
            not valid JSON (or not UTF-8), a line holds something other than an object, or an
            object repeats a key (orjson would keep the last value: which one was meant is
            ambiguous).
    """
    name = os.fspath(path)
    try:
        handle = open(name, "rb")  # bytes: json.loads decodes UTF-8 itself, faster than text mode
    except OSError as exc:
        raise TraceError(name, None, f"cannot open trace: {exc.strerror or exc}") from None
    with handle:
        for line, raw in enumerate(_read_lines(handle, name), start=1):
            if digest is not None:
                digest.update(raw)
            if raw.strip():
                yield line, _parse_object(name, line, raw)


def _read_lines(handle, name: str) -> Iterator[bytes]:
    """Lines of an open file, each at most ``MAX_LINE_BYTES``; an I/O error mid-file or a
    longer line becomes a TraceError."""
    line = 0
    try:
        for line, raw in enumerate(iter(lambda: handle.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(name, line, f"line longer than {MAX_LINE_BYTES >> 20} MiB, the limit for one trace record")
            yield raw
    except OSError as exc:
        raise TraceError(name, line or None, f"cannot read trace: {exc.strerror or exc}") from None


def record_line(path: str | os.PathLike, index: int) -> int:
    """The 1-based line of record ``index`` (0-based) of a JSONL trace: its ``index``-th
    non-blank line, as every reader counts records (``iter_json_objects``). Streams the file
    without parsing it (for messages about one record, after a successful load).

    Raises:
        IndexError: the file has at most ``index`` records.
        TraceError: the file cannot be opened or read, or has a line over ``MAX_LINE_BYTES``.
    """
    name = os.fspath(path)
    try:
        handle = open(name, "rb")
    except OSError as exc:
        raise TraceError(name, None, f"cannot open trace: {exc.strerror or exc}") from None
    with handle:
        records = (line for line, raw in enumerate(_read_lines(handle, name), start=1) if raw.strip())
        line = next(itertools.islice(records, index, None), None)
    if line is None:
        raise IndexError(f"{name}: no record {index}")
    return line


#: The first bytes of a gzip stream, and what a JSON Lines trace that starts with them is told.
_GZIP_MAGIC = b"\x1f\x8b"
_GZIPPED = ("gzip-compressed (it starts with bytes 1f 8b): a JSON Lines trace is read uncompressed, gunzip it first "
            "(only kv-cache-tester conversations are read as *.json.gz)")


_ORACLE_GENERAL = ("; a libCacheSim oracleGeneral file (what `tiercache trace export` writes) is for other simulators: "
                   "replay the trace it was exported from")


def _parse_object(name: str, line: int, raw: bytes) -> dict[str, Any]:
    # orjson (a JSON parser built for speed, UTF-8 validated, integers up to 2**64 - 1):
    # about 3x the json module on Mooncake lines, and parsing is most of a cold replay.
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith(("depth limit", "recursion limit")):
            raise TraceError(name, line, _TOO_DEEP) from None
        if line == 1 and raw.startswith(_GZIP_MAGIC):
            raise TraceError(name, line, _GZIPPED) from None
        binary = _not_utf8(raw)
        if binary and line == 1 and str(name).lower().endswith((".og", ".oraclegeneral")):
            binary += _ORACLE_GENERAL
        raise TraceError(name, line, binary or _malformed(exc, raw)) from None
    if not isinstance(obj, dict):
        raise TraceError(name, line, f"expected a JSON object, got {type(obj).__name__}")
    quotes = raw.count(b'"')
    if quotes != 2 * len(obj) and not keys_spelled_once(raw, [obj], quotes):  # most lines pass the first test
        repeated = _repeated_key(name, line, raw)
        if repeated is not None:
            raise TraceError(name, line, f"key {repeated!r} appears more than once in the record "
                                         "(which value is meant is ambiguous)")
    return obj


def keys_spelled_once(text: bytes, records: list[dict[str, Any]], quotes: int | None = None) -> bool:
    """True when no object of ``records`` can repeat a key; False when one may (then
    ``_repeated_key`` decides, line by line). orjson keeps a repeated key's last value
    without a word, so the readers look for repeats themselves, cheaply.

    ``text`` must hold the JSON text of ``records`` and nothing else but whitespace and
    separators; ``quotes`` is its count of double quotes when the caller has it. Every
    string, keys included, is spelled with at least two quotes (an escaped quote adds one),
    and the text holds at least one string per key of each record plus one per top-level
    string value: so ``quotes`` is at least twice that many, and exactly twice only if no
    key is repeated (and no string sits deeper). Failing that, and without a backslash
    (then every string is spelled as its bytes between two quotes), the spelling ``"key"``
    of each key must occur exactly as often as records hold the key (a repeat, a nested key
    or a string value equal to a key adds occurrences). Byte counts run at memory speed.
    """
    quotes = text.count(b'"') if quotes is None else quotes
    keys = sum(map(len, records))
    if quotes == 2 * keys:
        return True
    values = itertools.chain.from_iterable(map(dict.values, records))
    if quotes == 2 * (keys + list(map(type, values)).count(str)):
        return True
    if b"\\" in text:
        return False  # an escape can spell one key in two ways
    held = Counter(itertools.chain.from_iterable(records))
    return all(text.count(b'"' + key.encode() + b'"') == count for key, count in held.items())


def _repeated_key(name: str, line: int, raw: bytes) -> str | None:
    """The first key the top-level object of line ``line`` (bytes ``raw``, which orjson
    parsed) repeats, or None when it repeats none.

    Raises:
        TraceError: Python's json module cannot read the line (nested too deeply: its limit
            is about 1,000 levels, below orjson's 1,024): whether it repeats a key cannot be
            told, and a record that may repeat one is never accepted.
    """
    try:
        pairs = json.loads(raw, object_pairs_hook=list)  # the top-level object as (key, value) pairs
    except RecursionError:
        raise TraceError(name, line, _TOO_DEEP) from None
    except ValueError as exc:
        raise TraceError(name, line, _malformed(exc, raw)) from None
    return first_repeated_key(pairs)


def first_repeated_key(pairs: list[tuple[str, Any]]) -> str | None:
    """The first key of a JSON object's ``(key, value)`` pairs (in file order) that an
    earlier pair already has, or None."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    return None


def _malformed(exc: ValueError, raw: bytes) -> str:
    """A JSON error of one line, placed by column in that line (the decoder's own "line 2"
    counts the line's newline: beside the file's line number it would contradict it)."""
    pos = getattr(exc, "pos", None)
    if not isinstance(exc, json.JSONDecodeError) or pos is None:
        return f"malformed JSON: {exc}"
    where = "at the end of the line" if pos >= len(exc.doc.rstrip("\r\n")) else f"at column {pos + 1}"
    return f"malformed JSON: {exc.msg} {where}"


def _not_utf8(raw: bytes) -> str | None:
    """Where and why a line's bytes are not UTF-8 (orjson's own message names neither: it
    says "surrogates not allowed" at column 1 for any bad byte), or None if they are."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return (f"malformed JSON: not UTF-8: byte {raw[exc.start]:#04x} at column {exc.start + 1} "
                f"({exc.reason})")
    return None


def first_long_line(data: bytes, limit: int | None = None) -> int | None:
    """The 1-based number of the first line of ``data`` longer than ``limit`` bytes (its line
    break included; default ``MAX_LINE_BYTES``), or None when every line fits: the bound
    ``_read_lines`` enforces, so the bulk parsers defer such a file to it.

    Jumps ``limit`` bytes at a time to the last line break before the mark, so a file of
    short lines costs one ``rfind`` per ``limit`` bytes.
    """
    limit = MAX_LINE_BYTES if limit is None else limit
    pos = 0
    while len(data) - pos > limit:
        cut = data.rfind(b"\n", pos, pos + limit)
        if cut < 0:
            return data.count(b"\n", 0, pos) + 1
        pos = cut + 1
    return None


def seconds_field_ms(name: str, line: int, obj: dict[str, Any], field: str) -> int:
    """A required non-negative number of seconds (int or float; bool rejected), as integer
    milliseconds rounded to nearest.

    Raises:
        TraceError: missing, not a number, negative, not finite, or past 2**63 ms.
    """
    if field not in obj:
        raise TraceError(name, line, f"missing field {field!r}")
    value = obj[field]
    if type(value) not in (int, float) or not 0 <= value < _INT64_MAX / 1000:  # NaN fails the comparison
        shown = _shown(name, line, value, (field,))
        raise TraceError(name, line, f"field {field!r} must be a non-negative number of seconds below 2**63 ms "
                                     f"(about {_INT64_MAX / 1000:.4g} s), got {shown}")
    return round(value * 1000)


def int_field(name: str, line: int, obj: dict[str, Any], field: str) -> int:
    """A required non-negative integer field (``bool`` is rejected: JSON true is not a count).

    Raises:
        TraceError: missing, not an integer, or outside ``[0, 2**63)`` (an integer too large
            for orjson, which reads it as a float, is named with its exact digits).
    """
    if field not in obj:
        raise TraceError(name, line, f"missing field {field!r}")
    value = obj[field]
    if type(value) is float:
        value = _exact_integer(name, line, (field,), value)
    if type(value) is not int:
        raise TraceError(name, line, f"field {field!r} must be a non-negative integer, got {value!r}")
    if not 0 <= value <= _INT64_MAX:
        raise TraceError(name, line, f"field {field!r} must be in [0, 2**63), got {value}")
    return value


def token_field(name: str, line: int, obj: dict[str, Any], field: str) -> int:
    """A required token count (``input_length``, ``output_length``): an integer in
    ``[0, MAX_TOKENS]``.

    Raises:
        TraceError: as ``int_field``, or more than ``MAX_TOKENS`` (2**40) tokens.
    """
    value = int_field(name, line, obj, field)
    if value > MAX_TOKENS:
        raise TraceError(name, line, f"field {field!r} must be at most 2**40 tokens, got {value}")
    return value


def check_token_counts(name: str, requests: FlatTrace) -> None:
    """Checks a parsed request trace's token counts: each at most ``MAX_TOKENS`` (the line
    readers check it per line; this names a kv-cache-tester request by its arrival order) and
    the input lengths summing to at most ``MAX_TOTAL_TOKENS`` (2**62), so the prefill token
    sums of a replay stay inside int64.

    Raises:
        TraceError: naming the file and the first request past the bound.
    """
    for field in _TOKEN_FIELDS:
        values = getattr(requests, field + "s")
        if len(values) and int(values.max()) > MAX_TOKENS:
            first = int(np.argmax(values > MAX_TOKENS))
            raise TraceError(name, None, f"request {first} (in arrival order): {field} must be at most 2**40 tokens, "
                                         f"got {int(values[first])}")
    total = float(requests.input_lengths.sum(dtype=np.float64))  # a float sum cannot wrap
    if total > MAX_TOTAL_TOKENS:
        raise TraceError(name, None, f"the requests' input_length values sum to {total:.4g} tokens, more than 2**62")


def _exact_integer(name: str, line: int | None, path: tuple, value: Any) -> Any:
    """The integer the file holds where orjson read the float ``value``, else ``value``.

    orjson reads an integer beyond 2**64 - 1 as a float, so messages would show
    ``1.8446744073709552e+19`` for ``18446744073709551621``. On that error path only, line
    ``line`` of file ``name`` is read again with Python's json module (integers of any size)
    and the value at ``path`` (keys and list positions) is taken when it is an integer
    equal to ``value`` as a float; anything unexpected keeps ``value``.
    """
    if type(value) is not float or not line:
        return value
    try:
        with open(name, "rb") as handle:
            raw = next(itertools.islice(_read_lines(handle, name), line - 1, None), b"")
        exact = json.loads(raw)
        for key in path:
            exact = exact[key]
    except (OSError, ValueError, TypeError, KeyError, IndexError, RecursionError):
        return value
    return exact if type(exact) is int and float(exact) == value else value


def _shown(name: str, line: int | None, value: Any, path: tuple) -> str:
    """A value for a message: the exact integer behind a float orjson made of it, else repr."""
    exact = _exact_integer(name, line, path, value)
    return str(exact) if type(exact) is int and type(value) is float else repr(value)


def id_list_field(name: str, line: int, obj: dict[str, Any], field: str) -> list[int]:
    """A required list of block ids: integers in ``[0, 2**63)``, bools rejected.

    Raises:
        TraceError: missing, not a list, or an element that is not such an integer (the
            message gives its position and value).
    """
    if field not in obj:
        raise TraceError(name, line, f"missing field {field!r}")
    ids = obj[field]
    if type(ids) is not list:
        raise TraceError(name, line, f"field {field!r} must be a list of block ids, got {type(ids).__name__}")
    # One C-level pass over the types; the slow search below runs only on bad input.
    if ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) > _INT64_MAX):
        _raise_bad_id(name, line, field, ids)
    return ids


def _raise_bad_id(name: str, line: int, field: str, ids: list[Any]) -> None:
    for pos, value in enumerate(ids):
        value = _exact_integer(name, line, (field, pos), value)
        if type(value) is not int:
            raise TraceError(name, line, f"{field}[{pos}] must be an integer block id, got {value!r}")
        if not 0 <= value <= _INT64_MAX:
            raise TraceError(name, line, f"{field}[{pos}] must be in [0, 2**63), got {value}")
