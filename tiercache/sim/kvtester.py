"""kv-cache-tester traces: one JSON file per conversation, a file or a folder as one workload.

Format of one conversation file::

    {"block_size": 64,                       # tokens per block (required, same in every file)
     "hash_id_scope": "local",               # optional: "local" (default) or "global"
     "start": 12.5,                          # optional: arrival of the conversation, seconds
     "requests": [{"t": 0.0, "in": 1800, "out": 120, "hash_ids": [0, 1, ...], "type": "chat"},
                  {"t": 31.2, "in": 2100, "out": 90, "hash_ids": [0, 1, ..., 32], "type": "chat"}]}

``t`` is seconds since the conversation started (non-decreasing), ``in``/``out`` token counts,
``hash_ids`` one id per ``block_size``-token block of the prompt (a prefix tree, as in Mooncake
traces), ``type`` a free label. Ids are local to their file unless ``hash_id_scope`` is
``"global"``: local ids are renumbered into a range of their own per conversation, above every
global id, so two conversations never share a block by accident while global ids (a shared
system prompt, a shared document) are shared on purpose.

A folder's conversations are its own ``*.json`` and gzipped ``*.json.gz`` files (names in any
case); subfolders and other files are skipped, which ``skipped_entries_warning`` reports.

Arrivals: when every file names ``start``, conversations begin there; otherwise they arrive
by a Poisson process (mean gap ``mean_gap_s``, seeded), in sorted file-name order. The
requests of all conversations are merged by their arrival in whole milliseconds (ties by file
order, then request order) into one request trace with millisecond timestamps, like a
Mooncake trace.

Limits (a file past one is refused, by name): UTF-8 without a byte order mark, as JSONL
traces; ``block_size`` in ``[1, 2**31)``; ``in``/``out`` in ``[0, 2**40]`` (as JSONL traces); ids in ``[0, 2**63)``; ``t``,
``start`` and each arrival (``start + t``) below 2**63 ms; renumbered local ids below 2**63;
no key twice in the conversation or in one request (which value is meant would be ambiguous);
a conversation file is a regular file of at most ``MAX_CONVERSATION_BYTES`` (256 MiB; a device,
a FIFO or a bigger file is refused unread).

A request may list an id more than once (no real trace does; it is read as listed, and
``tiercache trace inspect`` counts such requests: ``tracestats``).
"""

from __future__ import annotations

import gzip
import io
import json
import numbers
import os
import stat
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from tiercache.errors import TraceError

from .kvfolder import GZIP_SUFFIX as _GZIP_SUFFIX, conversation_files as _files, is_conversation_name, skipped_entries_warning
from .steptrace import MAX_BLOCK_TOKENS
from .tracelines import MAX_LINE_BYTES, first_repeated_key
from .traces import MAX_TOKENS, FlatTrace, fingerprint_digest, fingerprint_of, id_list_field

__all__ = ["Conversation", "is_kvtester", "read_conversation", "load_kvtester_flat", "request_origin",
           "DEFAULT_MEAN_GAP_S", "MAX_CONVERSATION_BYTES", "is_conversation_name", "skipped_entries_warning"]

#: Mean gap between conversation arrivals when the files name no ``start`` (seconds).
DEFAULT_MEAN_GAP_S = 2.0
_SCOPES = ("local", "global")
_INT64_MAX = (1 << 63) - 1
#: Times (``t``, ``start``) are kept as int64 milliseconds: they must stay below 2**63 ms.
_MAX_SECONDS = _INT64_MAX / 1000
_UTF8_BOM = b"\xef\xbb\xbf"
#: The largest conversation file read (bytes): the bundled sample's are at most 24 KB, and even a
#: conversation of 100 turns of 100k-token prompts lists ids in a few MiB; the bound
#: keeps an endless or huge file (``/dev/zero``, a mistaken dump) from exhausting memory.
MAX_CONVERSATION_BYTES = 256 << 20
#: The names of a folder's conversation files, matched in any case: JSON, and JSON gzipped.


@dataclass(frozen=True)
class Conversation:
    """One conversation file, validated.

    Invariants: ``times`` non-decreasing seconds from the conversation's start; ``ids[r]``
    the block ids of request ``r`` as written in the file; one entry per request in every
    per-request tuple.
    """

    path: str
    block_size: int
    scope: str
    start: float | None
    times: tuple[float, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    ids: tuple[list[int], ...]


def is_kvtester(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding conversation files (``is_conversation_name``), or
    a file read as a conversation, as a folder's files are: a ``*.json.gz`` file, and any
    ``.json`` file (in any case) but JSON Lines, which is
    recognised by its first non-blank line alone being a JSON object that is a JSON Lines
    record (one with ``hash_ids``, or one with neither ``requests`` nor ``block_size``).

    So a conversation is recognised wherever its keys are (after a long first field, or
    pretty-printed over many lines), and a broken or unusual ``.json`` file gets the
    conversation reader's error. A folder without any ``.json`` file (empty, or of other
    files) is not a workload: the caller's usual "cannot open trace" error names it.
    """
    name = os.fspath(path)
    if os.path.isdir(name):
        try:
            return any(map(is_conversation_name, os.listdir(name)))
        except OSError:
            return False
    if name.lower().endswith(_GZIP_SUFFIX):
        return True  # no JSON Lines trace is read gzipped: the conversation reader takes it
    if not name.lower().endswith(".json"):
        return False
    try:
        if not stat.S_ISREG(os.stat(name).st_mode):
            return True  # a device or FIFO named .json: the conversation reader refuses it by name, unread
        with open(name, "rb") as handle:
            first = _first_line(handle)
    except OSError:
        return False
    if not first:
        return False  # empty: the JSON Lines reader says so
    try:
        record = orjson.loads(first)
    except orjson.JSONDecodeError:
        return True  # not a whole value on one line: one document over several lines (or malformed)
    if not isinstance(record, dict):
        return True
    return "hash_ids" not in record and ("requests" in record or "block_size" in record)


def _first_line(handle) -> bytes:
    """The first line of an open file that is not blank (at most ``MAX_LINE_BYTES + 1``
    bytes, so a file without line breaks is not read whole), or b"" at its end."""
    for raw in iter(lambda: handle.readline(MAX_LINE_BYTES + 1), b""):
        if raw.strip():
            return raw
    return b""


def read_conversation(path: str, raw: bytes) -> Conversation:
    """Parses one conversation file's bytes.

    The bytes must be UTF-8 without a byte order mark, as every JSONL trace must be.

    Raises:
        TraceError: not UTF-8 (or with a BOM), malformed JSON, a missing/invalid field, or
            a key repeated in the conversation or in a request (the message names the field
            or key and, for a request, its 0-based index).
    """
    obj = _parse_json(path, raw)
    if not isinstance(obj, dict):
        raise TraceError(path, None, f"expected a JSON object, got {type(obj).__name__}")
    _check_keys_once(path, obj, "the conversation")
    block_size = _positive_int(path, obj, "block_size", "", high=MAX_BLOCK_TOKENS)
    scope = obj.get("hash_id_scope", "local")
    if scope not in _SCOPES:
        raise TraceError(path, None, f"hash_id_scope must be one of {_SCOPES}, got {scope!r}")
    start = obj.get("start")
    if start is not None and not _is_seconds(start):
        raise TraceError(path, None, f"start must be a non-negative number of seconds below 2**63 ms, got {_show(start)}")
    requests = obj.get("requests")
    if not isinstance(requests, list) or not requests:
        raise TraceError(path, None, "requests must be a non-empty list")
    rows = [_request(path, index, req) for index, req in enumerate(requests)]
    times = tuple(r[0] for r in rows)
    for index in range(1, len(times)):
        if times[index] < times[index - 1]:
            raise TraceError(path, None, f"requests[{index}].t goes back in time ({times[index]} < {times[index - 1]})")
    return Conversation(path, block_size, scope, start, times, tuple(r[1] for r in rows), tuple(r[2] for r in rows),
                        tuple(r[3] for r in rows))


def _parse_json(path: str, raw: bytes) -> Any:
    """The JSON value of a file's bytes: strict UTF-8, no BOM (as the JSONL readers require).

    Raises:
        TraceError: a BOM, bytes that are not UTF-8, or malformed JSON.
    """
    if raw.startswith(_UTF8_BOM):
        raise TraceError(path, None, "malformed JSON: UTF-8 byte order mark (BOM) is not supported; save the file without it")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(path, None, f"malformed JSON: not UTF-8 (byte {exc.start} is {raw[exc.start]:#04x})") from None
    try:
        return json.loads(text, object_pairs_hook=_json_object)
    except (ValueError, RecursionError) as exc:
        lines = " (one JSON object per line is a JSON Lines trace, read only uncompressed: gunzip it)" \
            if path.lower().endswith(_GZIP_SUFFIX) and str(exc).startswith("Extra data") else ""
        raise TraceError(path, None, f"malformed JSON: {exc}{lines}") from None


class _RepeatedKeyObject(dict):
    """A JSON object that repeats a key (the last value kept, as ``json`` does); ``repeated``
    is the first key seen twice."""

    repeated: str


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json``'s ``object_pairs_hook``: the object as a dict, marked when it repeats a key,
    so the reader can name where (a repeat deeper than a request, in a field nobody reads,
    does not matter)."""
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    marked = _RepeatedKeyObject(obj)
    marked.repeated = first_repeated_key(pairs)
    return marked


def _check_keys_once(path: str, obj: dict, where: str) -> None:
    """Refuses an object that repeats a key: which value is meant is ambiguous.

    Raises:
        TraceError: naming the key and ``where`` (``"requests[3]"``, or ``"the
            conversation"``).
    """
    if isinstance(obj, _RepeatedKeyObject):
        raise TraceError(path, None, f"key {obj.repeated!r} appears more than once in {where} "
                                     "(which value is meant is ambiguous)")


def _request(path: str, index: int, req: Any) -> tuple[float, int, int, list[int]]:
    where = f"requests[{index}]"
    if not isinstance(req, dict):
        raise TraceError(path, None, f"{where} must be an object")
    _check_keys_once(path, req, where)
    t = req.get("t")
    if not _is_seconds(t):
        raise TraceError(path, None, f"{where}.t must be a non-negative number of seconds below 2**63 ms, got {_show(t)}")
    tokens_in = _positive_int(path, req, "in", where + ".", allow_zero=True, high=MAX_TOKENS)
    tokens_out = _positive_int(path, req, "out", where + ".", allow_zero=True, high=MAX_TOKENS)
    ids = id_list_field(f"{path}: {where}", None, req, "hash_ids")  # the message names the request
    return float(t), tokens_in, tokens_out, ids


def _is_seconds(value: Any) -> bool:
    """A JSON number (bool rejected) in ``[0, 2**63 / 1000)``: NaN, infinities and huge
    integers fail (Python compares an int of any size with a float exactly)."""
    return type(value) in (int, float) and 0 <= value < _MAX_SECONDS


def _show(value: Any) -> str:
    """``repr`` of a value for a message, cut short (a JSON integer may have any length)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _positive_int(path: str, obj: dict, field: str, where: str, allow_zero: bool = False,
                  high: int = _INT64_MAX) -> int:
    """A required integer field in ``[low, high]`` (low 0 or 1; high ``2**k`` or ``2**k - 1``,
    at most int64's max)."""
    value = obj.get(field)
    low = 0 if allow_zero else 1
    if type(value) is not int or not low <= value <= high:
        if high & (high - 1) == 0:  # a power of two: inclusive
            span = f"[{low}, 2**{high.bit_length() - 1}]"
        else:
            span = f"[{low}, 2**{(high + 1).bit_length() - 1})"
        raise TraceError(path, None, f"{where}{field} must be an integer in {span}, got {_show(value)}")
    return value


def load_kvtester_flat(path: str | os.PathLike, seed: int = 0,
                       mean_gap_s: float = DEFAULT_MEAN_GAP_S) -> tuple[FlatTrace, int, str]:
    """Reads a conversation file or a folder of them into one request trace.

    Returns:
        (flat arrays in arrival order, block size in tokens, fingerprint (``traces.
        fingerprint_digest``) of the files' bytes, their names, the seed and the mean gap, the
        last two in canonical form: ``mean_gap_s`` 2 and 2.0 give one fingerprint).

    Raises:
        TypeError: ``seed`` is not an integer (None would draw fresh arrivals on every load
            under one fingerprint), or ``mean_gap_s`` not a real number.
        ValueError: ``seed`` negative, or ``mean_gap_s`` not finite and > 0 where it is used.
        TraceError: unreadable, oversized, non-regular or malformed file, or files with
            different block sizes.
    """
    seed, mean_gap_s = _arrival_args(seed, mean_gap_s)
    name = os.fspath(path)
    digest = fingerprint_digest()
    convs = []
    for file in _files(name):
        raw = _read_file(file)
        # fsencode: the name's own bytes (a UTF-8 name's as before; one that is not UTF-8 arrives
        # surrogate-escaped from os.listdir, which .encode() refuses). A gzipped file's bytes as stored.
        digest.update(os.fsencode(os.path.basename(file)) + b"\0" + raw)
        convs.append(read_conversation(file, _unpacked(file, raw)))
    sizes = {c.block_size for c in convs}
    if len(sizes) != 1:
        raise TraceError(name, None, f"conversations disagree on block_size: {sorted(sizes)}")
    digest.update(f"seed={seed},gap={mean_gap_s!r}".encode())
    return _merge(convs, _starts(convs, seed, mean_gap_s)), sizes.pop(), fingerprint_of(digest)


def request_origin(path: str | os.PathLike, index: int, seed: int = 0,
                   mean_gap_s: float = DEFAULT_MEAN_GAP_S) -> tuple[str, int]:
    """Where request ``index`` (0-based, in arrival order) of a workload comes from: its
    conversation file and its index in that file's ``requests``. Reads the workload again
    (for messages about one request; the replay's loading path never calls it).

    Raises:
        IndexError: ``index`` is not a request of the workload.
        TypeError, ValueError, TraceError: as ``load_kvtester_flat``.
    """
    seed, mean_gap_s = _arrival_args(seed, mean_gap_s)
    convs = [read_conversation(file, _unpacked(file, _read_file(file))) for file in _files(os.fspath(path))]
    _, c, r = _arrival_rows(convs, _starts(convs, seed, mean_gap_s))[index]
    return convs[c].path, r


def _arrival_args(seed: object, mean_gap_s: object) -> tuple[int, float]:
    """``seed`` as an int and ``mean_gap_s`` as a float, the forms the fingerprint hashes.

    Raises:
        TypeError: ``seed`` not an integer (bool and None included), ``mean_gap_s`` not a real
            number (bool included).
        ValueError: ``seed`` negative (numpy's generators refuse it).
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"arrival_seed must be an integer (the fingerprint names it), got {seed!r}")
    if seed < 0:
        raise ValueError(f"arrival_seed must be >= 0, got {seed}")
    if isinstance(mean_gap_s, bool) or not isinstance(mean_gap_s, numbers.Real):
        raise TypeError(f"mean_gap_s must be a number of seconds, got {mean_gap_s!r}")
    return int(seed), float(mean_gap_s)


def _read_file(file: str) -> bytes:
    """The bytes of one conversation file, read only if it is a regular file, at most
    ``MAX_CONVERSATION_BYTES + 1`` of them (never a whole endless or huge file).

    Opened non-blocking, so a FIFO is refused at once rather than waited on.

    Raises:
        TraceError: (naming the file) it cannot be opened or read, is not a regular file (a
            folder, a device, a FIFO, a socket), or is larger than the limit.
    """
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        raise TraceError(file, None, f"cannot open trace: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise TraceError(file, None, "cannot open trace: a folder, not a conversation file")
        if not stat.S_ISREG(mode):
            raise TraceError(file, None, "cannot open trace: not a regular file (a device, FIFO or socket); "
                                         "a conversation must be a JSON file")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            raw = handle.read(MAX_CONVERSATION_BYTES + 1)
    except OSError as exc:
        raise TraceError(file, None, f"cannot read trace: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_CONVERSATION_BYTES:
        raise TraceError(file, None, f"larger than {MAX_CONVERSATION_BYTES >> 20} MiB, the limit for one conversation file")
    return raw


def _unpacked(file: str, raw: bytes) -> bytes:
    """A conversation file's JSON bytes: ``raw``, or a ``*.json.gz`` file's gzip stream
    decompressed, at most ``MAX_CONVERSATION_BYTES`` of them (a small file that inflates
    without end is refused, never read whole).

    Raises:
        TraceError: (naming the file) not a whole gzip stream, or over the limit inflated.
    """
    if not file.lower().endswith(_GZIP_SUFFIX):
        return raw
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as stream:
            data = stream.read(MAX_CONVERSATION_BYTES + 1)
    except (OSError, EOFError, zlib.error) as exc:  # BadGzipFile is an OSError; a cut stream, EOFError
        raise TraceError(file, None, f"cannot read trace: not a whole gzip file ({exc})") from None
    if len(data) > MAX_CONVERSATION_BYTES:
        raise TraceError(file, None, f"larger than {MAX_CONVERSATION_BYTES >> 20} MiB decompressed, the limit for one "
                                     "conversation file")
    return data


def _starts(convs: list[Conversation], seed: int, mean_gap_s: float) -> list[float]:
    """Given offsets when every file names one, else seeded Poisson arrivals."""
    if all(c.start is not None for c in convs):
        return [float(c.start) for c in convs]
    if not 0 < mean_gap_s < float("inf"):  # NaN fails too
        raise ValueError(f"mean_gap_s must be a finite number > 0, got {mean_gap_s}")
    gaps = np.random.default_rng(seed).exponential(mean_gap_s, size=len(convs))
    return list(np.cumsum(gaps) - gaps[0])


def _global_ids(convs: list[Conversation]) -> list[list[list[int]]]:
    """Each conversation's id lists with local ids renumbered above every global id.

    Conversation ``c``'s local id ``i`` becomes ``base_c + i``, where ``base_c`` is one past
    the largest global id and every earlier local conversation's range.

    Raises:
        TraceError: a conversation's renumbered ids would pass 2**63 - 1 (names the file).
    """
    top = max((max(ids) for c in convs if c.scope == "global" for ids in c.ids if ids), default=-1)
    base = top + 1
    out = []
    for conv in convs:
        if conv.scope == "global":
            out.append(list(conv.ids))
            continue
        largest = max((max(ids) for ids in conv.ids if ids), default=-1)
        if base + largest > _INT64_MAX:
            raise TraceError(conv.path, None, f"local hash_ids up to {largest}, renumbered from {base} (above every global "
                             "id and the earlier conversations' local ids), would pass 2**63 - 1; use smaller local ids")
        out.append([[base + i for i in ids] for ids in conv.ids])
        base += 1 + largest
    return out


def _arrival_rows(convs: list[Conversation], starts: list[float]) -> list[tuple[int, int, int]]:
    """``(arrival in ms, conversation, request)`` of every request, sorted: by the millisecond
    time the trace stores (``round((start + t) * 1000)``), ties by file order, then request
    order (float sums would break some ties by rounding noise: 0.1 + 0.2 > 0.3)."""
    rows = [(round((starts[c] + t) * 1000), c, r) for c, conv in enumerate(convs) for r, t in enumerate(conv.times)]
    rows.sort()
    return rows


def _merge(convs: list[Conversation], starts: list[float]) -> FlatTrace:
    """All requests in arrival order (``_arrival_rows``).

    Raises:
        TraceError: renumbered ids past int64 (``_global_ids``), or an arrival (start + t)
            past 2**63 ms (names the file and the request).
    """
    ids = _global_ids(convs)
    rows = _arrival_rows(convs, starts)
    _check_last_arrival(convs, starts, rows[-1])
    lists = [ids[c][r] for _, c, r in rows]
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    flat = np.fromiter((i for lst in lists for i in lst), dtype=np.int64, count=int(lengths.sum()))
    offsets = np.zeros(len(rows), dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    stamps = np.array([stamp for stamp, _, _ in rows], dtype=np.int64)
    inputs = np.array([convs[c].inputs[r] for _, c, r in rows], dtype=np.int64)
    outputs = np.array([convs[c].outputs[r] for _, c, r in rows], dtype=np.int64)
    return FlatTrace(flat, offsets, stamps, inputs, outputs)


def _check_last_arrival(convs: list[Conversation], starts: list[float], last: tuple[int, int, int]) -> None:
    """The latest arrival (rows are sorted) must be below 2**63 ms, the timestamps' int64."""
    stamp, c, r = last
    if stamp > _INT64_MAX:
        raise TraceError(convs[c].path, None, f"requests[{r}] arrives at {starts[c] + convs[c].times[r]:g} s "
                         "(conversation start + t), past the 2**63 ms a timestamp can hold")
