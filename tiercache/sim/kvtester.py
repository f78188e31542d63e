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

Arrivals: when every file names ``start``, conversations begin there; otherwise they arrive
by a Poisson process (mean gap ``mean_gap_s``, seeded), in sorted file-name order. The
requests of all conversations are merged by arrival time (ties by file order, then request
order) into one request trace with millisecond timestamps, like a Mooncake trace.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiercache.errors import TraceError

from .traces import FlatTrace, fingerprint_digest, fingerprint_of, id_list_field

__all__ = ["Conversation", "is_kvtester", "read_conversation", "load_kvtester_flat", "DEFAULT_MEAN_GAP_S"]

#: Mean gap between conversation arrivals when the files name no ``start`` (seconds).
DEFAULT_MEAN_GAP_S = 2.0
_SCOPES = ("local", "global")


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
    """Whether ``path`` is a folder holding ``.json`` files, or a ``.json`` file with ``requests``.

    A folder without any (empty, or of other files) is not a workload: the caller's usual
    "cannot open trace" error names it.
    """
    name = os.fspath(path)
    if os.path.isdir(name):
        try:
            return any(f.endswith(".json") for f in os.listdir(name))
        except OSError:
            return False
    if not name.endswith(".json"):
        return False
    try:
        with open(name, "rb") as handle:
            head = handle.read(4096).lstrip()
    except OSError:
        return False
    return head.startswith(b"{") and (b'"requests"' in head or b'"block_size"' in head)


def read_conversation(path: str, raw: bytes) -> Conversation:
    """Parses one conversation file's bytes.

    Raises:
        TraceError: malformed JSON or a missing/invalid field (the message names the field
            and, for a request, its 0-based index).
    """
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise TraceError(path, None, f"malformed JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise TraceError(path, None, f"expected a JSON object, got {type(obj).__name__}")
    block_size = _positive_int(path, obj, "block_size", "")
    scope = obj.get("hash_id_scope", "local")
    if scope not in _SCOPES:
        raise TraceError(path, None, f"hash_id_scope must be one of {_SCOPES}, got {scope!r}")
    start = obj.get("start")
    if start is not None and (not _is_number(start) or start < 0):
        raise TraceError(path, None, f"start must be a non-negative number of seconds, got {start!r}")
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


def _request(path: str, index: int, req: Any) -> tuple[float, int, int, list[int]]:
    where = f"requests[{index}]"
    if not isinstance(req, dict):
        raise TraceError(path, None, f"{where} must be an object")
    t = req.get("t")
    if not _is_number(t) or t < 0:
        raise TraceError(path, None, f"{where}.t must be a non-negative number of seconds, got {t!r}")
    tokens_in = _positive_int(path, req, "in", where + ".", allow_zero=True)
    tokens_out = _positive_int(path, req, "out", where + ".", allow_zero=True)
    ids = id_list_field(f"{path}: {where}", None, req, "hash_ids")  # the message names the request
    return float(t), tokens_in, tokens_out, ids


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and value == value and value not in (float("inf"), float("-inf"))


def _positive_int(path: str, obj: dict, field: str, where: str, allow_zero: bool = False) -> int:
    value = obj.get(field)
    low = 0 if allow_zero else 1
    if type(value) is not int or value < low:
        raise TraceError(path, None, f"{where}{field} must be an integer >= {low}, got {value!r}")
    return value


def _files(name: str) -> list[str]:
    if not os.path.isdir(name):
        return [name]
    files = sorted(os.path.join(name, f) for f in os.listdir(name) if f.endswith(".json"))
    if not files:
        raise TraceError(name, None, "no conversation files (*.json) in the folder")
    return files


def load_kvtester_flat(path: str | os.PathLike, seed: int = 0,
                       mean_gap_s: float = DEFAULT_MEAN_GAP_S) -> tuple[FlatTrace, int, str]:
    """Reads a conversation file or a folder of them into one request trace.

    Returns:
        (flat arrays in arrival order, block size in tokens, fingerprint (``traces.
        fingerprint_digest``) of the files' bytes, their names, the seed and the mean gap).

    Raises:
        TraceError: unreadable or malformed file, or files with different block sizes.
    """
    name = os.fspath(path)
    digest = fingerprint_digest()
    convs = []
    for file in _files(name):
        try:
            with open(file, "rb") as handle:
                raw = handle.read()
        except OSError as exc:
            raise TraceError(file, None, f"cannot open trace: {exc.strerror or exc}") from None
        digest.update(os.path.basename(file).encode() + b"\0" + raw)
        convs.append(read_conversation(file, raw))
    sizes = {c.block_size for c in convs}
    if len(sizes) != 1:
        raise TraceError(name, None, f"conversations disagree on block_size: {sorted(sizes)}")
    digest.update(f"seed={seed},gap={mean_gap_s}".encode())
    return _merge(convs, _starts(convs, seed, mean_gap_s)), sizes.pop(), fingerprint_of(digest)


def _starts(convs: list[Conversation], seed: int, mean_gap_s: float) -> list[float]:
    """Given offsets when every file names one, else seeded Poisson arrivals."""
    if all(c.start is not None for c in convs):
        return [float(c.start) for c in convs]
    if mean_gap_s <= 0:
        raise ValueError(f"mean_gap_s must be > 0, got {mean_gap_s}")
    gaps = np.random.default_rng(seed).exponential(mean_gap_s, size=len(convs))
    return list(np.cumsum(gaps) - gaps[0])


def _global_ids(convs: list[Conversation]) -> list[list[list[int]]]:
    """Each conversation's id lists with local ids renumbered above every global id."""
    top = max((max(ids) for c in convs if c.scope == "global" for ids in c.ids if ids), default=-1)
    base = top + 1
    out = []
    for conv in convs:
        if conv.scope == "global":
            out.append(list(conv.ids))
            continue
        out.append([[base + i for i in ids] for ids in conv.ids])
        base += 1 + max((max(ids) for ids in conv.ids if ids), default=-1)
    return out


def _merge(convs: list[Conversation], starts: list[float]) -> FlatTrace:
    """All requests in arrival order (ties: file order, then request order)."""
    ids = _global_ids(convs)
    rows = [(starts[c] + t, c, r) for c, conv in enumerate(convs) for r, t in enumerate(conv.times)]
    rows.sort()
    lists = [ids[c][r] for _, c, r in rows]
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    flat = np.fromiter((i for lst in lists for i in lst), dtype=np.int64, count=int(lengths.sum()))
    offsets = np.zeros(len(rows), dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    stamps = np.array([round(when * 1000) for when, _, _ in rows], dtype=np.int64)
    inputs = np.array([convs[c].inputs[r] for _, c, r in rows], dtype=np.int64)
    outputs = np.array([convs[c].outputs[r] for _, c, r in rows], dtype=np.int64)
    return FlatTrace(flat, offsets, stamps, inputs, outputs)
