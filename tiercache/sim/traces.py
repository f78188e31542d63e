"""Mooncake request traces: a streaming, validating reader, flat arrays for replay, a writer.

Format (JSONL, one request per line, as published by the Mooncake project)::

    {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, 2, ...]}

``timestamp`` is the arrival time in milliseconds, ``input_length``/``output_length`` are
token counts, and ``hash_ids`` holds one id per 512-token block of the prompt. Ids form a
prefix tree: an id names the whole prefix that ends with its block, so two requests share
id ``x`` at position ``i`` only when they share the first ``i + 1`` blocks. Other fields
are ignored; blank lines are skipped.

Alibaba's Bailian (Qwen) serving traces, released with "KVCache Cache in the Wild" (Wang et
al., 2025), are read too: their records also carry ``chat_id`` and ``parent_chat_id`` (and
``type``, ``turn``), ``timestamp`` is in seconds (a float) and each ``hash_ids`` entry is a
16-token block. A file whose first record has both ``chat_id`` and ``parent_chat_id`` is read
so (``request_format``): its timestamps become milliseconds (rounded) and its block size is 16.

Every reader streams the file line by line (never loads it whole) and reports bad input as
``TraceError(path, line, message)`` with the 1-based line number.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
import orjson
import xxhash

from tiercache.errors import TraceError, UserError
from tiercache.policies.base import NO_NEXT_USE
from tiercache.results import TraceKind
from tiercache.results.records import FINGERPRINT_PREFIX, legacy_fingerprint

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "BAILIAN_BLOCK_TOKENS",
    "request_format",
    "format_block_tokens",
    "Request",
    "FlatTrace",
    "iter_requests",
    "load_flat",
    "flat_requests",
    "flat_ids",
    "request_offsets",
    "next_use",
    "trace_fingerprint",
    "fingerprint_digest",
    "fingerprint_of",
    "write_requests",
    "request_json",
    "TraceKind",
    "detect_kind",
    "kind_of",
    "iter_json_objects",
    "int_field",
    "token_field",
    "id_list_field",
    "check_token_counts",
    "MAX_TOKENS",
    "MAX_TOTAL_TOKENS",
    "MAX_LINE_BYTES",
    "first_long_line",
]

#: Tokens per ``hash_ids`` block in Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512
#: Tokens per ``hash_ids`` block in Alibaba's Bailian (Qwen) traces.
BAILIAN_BLOCK_TOKENS = 16

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


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a Mooncake trace.

    Invariants: every integer is non-negative; ``hash_ids`` holds ints below 2**63;
    ``line`` is the 1-based line of the request in its file (0 for synthesized requests
    that were never read from a file).
    """

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int = 0


@dataclass(frozen=True)
class FlatTrace:
    """A whole request trace as arrays (struct of arrays), for the replay hot path.

    Invariants: ``ids`` holds every block access in trace order; request ``r`` owns
    ``ids[offsets[r]:offsets[r + 1]]`` (the last one runs to ``len(ids)``); ``offsets``
    is non-decreasing and starts at 0; the per-request arrays all have one entry per request.
    """

    ids: np.ndarray
    offsets: np.ndarray
    timestamps: np.ndarray
    input_lengths: np.ndarray
    output_lengths: np.ndarray

    @property
    def num_requests(self) -> int:
        return len(self.offsets)


# ----------------------------------------------------------------------------- parsing helpers


def iter_json_objects(path: str | os.PathLike, digest: Any = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yields ``(line, object)`` for each non-blank line of a JSONL file, streamed.

    ``digest`` (a ``fingerprint_digest``), when given, is updated with every byte of the file
    (blank lines included), so a reader that runs to the end also has the file's digest.

    Raises:
        TraceError: the file cannot be opened (missing, a directory, unreadable), a line is
            not valid JSON (or not UTF-8), or a line holds something other than an object.
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


def _parse_object(name: str, line: int, raw: bytes) -> dict[str, Any]:
    # orjson (a JSON parser built for speed, UTF-8 validated, integers up to 2**64 - 1):
    # about 3x the json module on Mooncake lines, and parsing is most of a cold replay.
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith(("depth limit", "recursion limit")):
            raise TraceError(name, line, "malformed record: JSON nested too deeply") from None
        raise TraceError(name, line, _not_utf8(raw) or f"malformed JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise TraceError(name, line, f"expected a JSON object, got {type(obj).__name__}")
    return obj


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


def request_format(first: dict[str, Any]) -> str:
    """``"bailian"`` when a request trace's first record names its chat and parent chat
    (Alibaba's Bailian traces: seconds, 16-token blocks), else ``"mooncake"``."""
    return "bailian" if "chat_id" in first and "parent_chat_id" in first else "mooncake"


def format_block_tokens(fmt: str) -> int:
    """Tokens per ``hash_ids`` block of a request-trace format (``request_format``)."""
    return BAILIAN_BLOCK_TOKENS if fmt == "bailian" else MOONCAKE_BLOCK_TOKENS


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


# ----------------------------------------------------------------------------- requests


def iter_requests(path: str | os.PathLike) -> Iterator[Request]:
    """Streams the requests of a Mooncake trace, validated, in file order.

    Raises:
        TraceError: unreadable file, malformed line, missing or invalid field, or a file
            without any request (raised after the last line, since the reader streams).
    """
    name = os.fspath(path)
    count = 0
    for line, obj in iter_json_objects(name):
        ints = [int_field(name, line, obj, "timestamp")] + [token_field(name, line, obj, f) for f in _TOKEN_FIELDS]
        ids = id_list_field(name, line, obj, "hash_ids")
        count += 1
        yield Request(ints[0], ints[1], ints[2], tuple(ids), line)
    if count == 0:
        raise TraceError(name, None, "no requests: the trace is empty")


def load_flat(path: str | os.PathLike) -> FlatTrace:
    """Reads a Mooncake trace once into flat arrays (object semantics: every id an access).

    Raises:
        TraceError: as ``iter_requests``.
    """
    name = os.fspath(path)
    return flat_requests(name, iter_json_objects(name))


def flat_requests(name: str, objects: Iterable[tuple[int, dict[str, Any]]]) -> FlatTrace:
    """Flat arrays of the request records ``objects`` (``(line, object)`` of file ``name``);
    timestamps in milliseconds (a Bailian trace's seconds converted, see ``request_format``).

    Raises:
        TraceError: as ``iter_requests``.
    """
    id_lists: list[list[int]] = []
    meta: list[tuple[int, int, int]] = []
    stamp = int_field
    fmt = None
    # Parse without building Request objects: this runs on every replay.
    for line, obj in objects:
        if fmt is None:
            fmt = request_format(obj)
            stamp = seconds_field_ms if fmt == "bailian" else int_field
        elif request_format(obj) != fmt:
            _raise_mixed_formats(name, line, fmt)
        meta.append((stamp(name, line, obj, "timestamp"), token_field(name, line, obj, "input_length"),
                     token_field(name, line, obj, "output_length")))
        id_lists.append(id_list_field(name, line, obj, "hash_ids"))
    if not meta:
        raise TraceError(name, None, "no requests: the trace is empty")
    lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    total = int(lengths.sum())
    ids = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int64, count=total)
    offsets = np.zeros(len(meta), dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    cols = np.array(meta, dtype=np.int64).reshape(len(meta), 3)
    return FlatTrace(ids, offsets, cols[:, 0].copy(), cols[:, 1].copy(), cols[:, 2].copy())


def _raise_mixed_formats(name: str, line: int, fmt: str) -> None:
    """A record whose format (``request_format``) is not the first record's: a Bailian trace
    counts seconds and 16-token blocks, a Mooncake trace milliseconds and 512-token blocks,
    so one file cannot hold both."""
    if fmt == "bailian":
        found = "lacks 'chat_id' or 'parent_chat_id'"
    else:
        found = "has 'chat_id' and 'parent_chat_id' (a Bailian record)"
    raise TraceError(name, line, f"the record {found}, but the first record is a {fmt.capitalize()} record: "
                                 "one trace holds one format (Bailian: seconds, 16-token blocks; Mooncake: "
                                 "milliseconds, 512-token blocks)")


def flat_ids(path: str | os.PathLike) -> np.ndarray:
    """All ``hash_ids`` of a Mooncake trace in order, as one int64 array (object semantics)."""
    return load_flat(path).ids


def request_offsets(path: str | os.PathLike) -> np.ndarray:
    """Start index, in ``flat_ids(path)``, of each request (int64, one entry per request).

    Use ``load_flat`` to get ids and offsets from a single parse.
    """
    return load_flat(path).offsets


def next_use(ids: np.ndarray) -> np.ndarray:
    """Index of each access's next access to the same id, ``NO_NEXT_USE`` where none.

    Vectorized: one stable argsort groups equal ids with their accesses in time order, so
    each access's successor within its group is its next use. O(n log n), no Python loop.

    Invariants of the result ``nu``: ``nu[i] > i``; ``ids[nu[i]] == ids[i]`` where
    ``nu[i] != NO_NEXT_USE``; no access of ``ids[i]`` lies strictly between ``i`` and ``nu[i]``.
    """
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"next_use: ids must be 1-D, got shape {ids.shape}")
    result = np.full(len(ids), NO_NEXT_USE, dtype=np.int64)
    if len(ids) < 2:
        return result
    order = np.argsort(ids, kind="stable")
    same = ids[order[1:]] == ids[order[:-1]]
    result[order[:-1][same]] = order[1:][same]
    return result


def fingerprint_digest(legacy: bool = False):
    """A fresh streaming digest for a trace fingerprint (``fingerprint_of`` turns it into the
    text): xxh3-128, ~60x faster than blake2b, which a cold load paid for on every trace;
    ``legacy`` gives the blake2b-128 that results written before it recorded."""
    return hashlib.blake2b(digest_size=16) if legacy else xxhash.xxh3_128()


def fingerprint_of(digest) -> str:
    """The fingerprint text of a finished ``fingerprint_digest``."""
    text = digest.hexdigest()
    return text if isinstance(digest, type(hashlib.blake2b())) else FINGERPRINT_PREFIX + text


def trace_fingerprint(path: str | os.PathLike, like: str | None = None) -> str:
    """The fingerprint of the file's bytes (``xxh3-128:<hex>``), streamed in 1 MiB chunks; with
    ``like`` a legacy fingerprint, the blake2b-128 hex digest earlier versions recorded, so a
    result written by one can still be matched to its trace.

    Identifies the exact trace a result came from (reports record it next to results).

    Raises:
        TraceError: the file cannot be read.
    """
    name = os.fspath(path)
    digest = fingerprint_digest(legacy=like is not None and legacy_fingerprint(like))
    try:
        with open(name, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as exc:
        raise TraceError(name, None, f"cannot read trace: {exc.strerror or exc}") from None
    return fingerprint_of(digest)


# ----------------------------------------------------------------------------- writer


def request_json(request: Request) -> str:
    """One Mooncake JSONL line (without newline) for a request; fields in Mooncake's order."""
    ids = ", ".join(map(str, request.hash_ids))
    return (
        f'{{"timestamp": {request.timestamp}, "input_length": {request.input_length}, '
        f'"output_length": {request.output_length}, "hash_ids": [{ids}]}}'
    )


def write_requests(path: str | os.PathLike, requests: Iterable[Request]) -> int:
    """Writes requests as a Mooncake JSONL trace; returns the number written.

    Raises:
        UserError: the file cannot be written (the message names it).
    """
    return write_jsonl(path, map(request_json, requests), "trace")


def write_jsonl(path: str | os.PathLike, lines: Iterable[str], what: str) -> int:
    """Writes one JSON text per line; returns the number written.

    Raises:
        UserError: the file cannot be written (the message names it and ``what`` it is).
    """
    name = os.fspath(path)
    count = 0
    try:
        with open(name, "w", encoding="utf-8") as handle:
            for line in lines:
                handle.write(line + "\n")
                count += 1
    except OSError as exc:
        raise UserError(f"{name}: cannot write {what}: {exc.strerror or exc}") from None
    return count


# ----------------------------------------------------------------------------- kind detection


def detect_kind(path: str | os.PathLike) -> TraceKind:
    """Tells a request trace from a step trace by the first record's fields.

    ``tiercache.sim.loader.load_trace`` reads a whole trace of either kind in one pass.

    Raises:
        TraceError: unreadable or empty file, or a first record that is neither kind.
    """
    name = os.fspath(path)
    for line, obj in iter_json_objects(name):
        return kind_of(name, line, obj)
    raise TraceError(name, None, "no records: the trace is empty")


def kind_of(name: str, line: int, first: dict[str, Any]) -> TraceKind:
    """The kind of a trace whose first record is ``first`` (at ``line`` of file ``name``).

    Raises:
        TraceError: the record is neither a request nor a step record.
    """
    if "hash_ids" in first:
        return TraceKind.REQUESTS
    if "step" in first or "block_tokens" in first:  # a step record, or a step trace's header
        return TraceKind.STEPS
    expected = "expected a Mooncake request (with 'hash_ids') or a step record (with 'step')"
    if "requests" in first:
        expected += ("; this looks like a kv-cache-tester conversation (with 'requests'): "
                     "name the file *.json, or give its folder")
    raise TraceError(name, line, f"not a known trace: {expected}")
