"""One trace loader: a request trace or a step trace, read once, its kind detected.

``load_trace`` streams the file a single time: the first record tells the kind, the same
pass builds the flat arrays and hashes the bytes for the fingerprint. Replays, sweeps,
``tiercache trace inspect`` and the report's LRU curve all start from the ``Trace`` it returns.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import numpy as np
import orjson

from tiercache.errors import TraceError, UserError
from tiercache.results import TraceInfo, TraceKind

from .bulkparse import load_requests
from .kvtester import DEFAULT_MEAN_GAP_S, is_conversation_name, is_kvtester, load_kvtester_flat
from .steptrace import FlatSteps, flat_steps, header_block_tokens, is_header
from .traces import (MAX_LINE_BYTES, MOONCAKE_BLOCK_TOKENS, FlatTrace, check_token_counts, fingerprint_digest, refuse_special_file,
                     fingerprint_of, flat_requests, format_block_tokens, half_fingerprint, iter_json_objects, kind_of,
                     request_format, trace_fingerprint)

__all__ = ["Trace", "load_trace", "load_request_trace", "trace_fingerprint", "half_fingerprint", "is_kvtester_workload"]


@dataclass(frozen=True)
class Trace:
    """A whole trace as flat arrays, with its kind and fingerprint.

    Invariants: record ``r`` (a request, or a step record) owns ``ids[offsets[r]:offsets[r + 1]]``;
    ``offsets`` has one entry per record plus an end entry equal to ``len(ids)``, starts at 0
    and never decreases. Exactly one of ``requests`` (request traces: timestamps, token
    counts) and ``steps`` (step traces: write flags, steps, layers) is set, matching ``kind``.
    ``fingerprint`` is the xxh3-128 of the file's bytes (``trace_fingerprint``), or for a
    kv-cache-tester workload of its files' names and bytes, the arrival seed and the gap.
    ``block_tokens`` is the tokens per block: 512 for Mooncake request traces, the
    ``block_size`` of a kv-cache-tester workload, a step trace's header value, or None for a
    step trace without a header. ``dense`` and ``next_use`` (``tiercache.sim.prep``), when
    set, come from the binary trace cache.
    """

    path: str
    kind: TraceKind
    fingerprint: str
    ids: np.ndarray
    offsets: np.ndarray
    requests: FlatTrace | None = None
    steps: FlatSteps | None = None
    block_tokens: int | None = MOONCAKE_BLOCK_TOKENS
    dense: np.ndarray | None = None
    next_use: np.ndarray | None = None

    def __post_init__(self) -> None:
        present = (self.requests is not None, self.steps is not None)
        if present != (self.kind is TraceKind.REQUESTS, self.kind is TraceKind.STEPS):
            raise ValueError(f"Trace {self.path}: the detail arrays must match the kind {self.kind.value}")
        if len(self.offsets) < 2 or int(self.offsets[-1]) != len(self.ids):
            raise ValueError(f"Trace {self.path}: offsets must end with len(ids)")

    @property
    def records(self) -> int:
        """Requests (request traces) or step records (step traces)."""
        return len(self.offsets) - 1

    @property
    def input_lengths(self) -> np.ndarray | None:
        """Prompt tokens of each request (request traces only)."""
        return None if self.requests is None else self.requests.input_lengths

    @property
    def is_write(self) -> np.ndarray | None:
        """Per access: True where a step stores the block (step traces only)."""
        return None if self.steps is None else self.steps.is_write

    def info(self) -> TraceInfo:
        """The ``trace`` record of results.json."""
        return TraceInfo(
            path=os.path.abspath(self.path), name=os.path.basename(self.path), fingerprint=self.fingerprint,
            kind=self.kind, requests=self.records, accesses=len(self.ids), unique_blocks=distinct_count(self.ids),
        )


def distinct_count(ids: np.ndarray) -> int:
    """How many distinct values ``ids`` holds: a sort and a count of changes (``np.unique``'s
    hashing path took 9 s on 10M ids against 0.9 s for the sort, probe Q76)."""
    if len(ids) == 0:
        return 0
    ordered = np.sort(ids)
    return int(np.count_nonzero(ordered[1:] != ordered[:-1])) + 1


def load_request_trace(path: str | os.PathLike) -> Trace:
    """``load_trace(path)`` of a request trace (Mooncake, Bailian, kv-cache-tester).

    Raises:
        TraceError: as ``load_trace``.
        UserError: a step trace (its reads and writes are no requests: prefix semantics, and
            a gap measured on it, mean nothing there).
    """
    trace = load_trace(path)
    if trace.kind is not TraceKind.REQUESTS:
        raise UserError(f"--trace {os.fspath(path)}: a step trace; this script replays request traces (Mooncake, Bailian "
                        "or kv-cache-tester), whose requests reuse a prefix")
    return trace


def load_trace(path: str | os.PathLike, arrival_seed: int = 0, mean_gap_s: float = DEFAULT_MEAN_GAP_S) -> Trace:
    """Reads a request or step trace in one pass (or a kv-cache-tester file or folder).

    ``arrival_seed`` and ``mean_gap_s`` set the Poisson arrivals of kv-cache-tester
    conversations whose files give no ``start`` (ignored for every other trace).

    Raises:
        TraceError: unreadable or empty file, a first record of neither kind, any error of
            the kind's reader (the message names the file and the 1-based line), a folder
            without conversation files, or a trace without a single block access (as
            ``_replay_accesses`` counts them: a step trace that only writes has none).
    """
    trace = _load(_folder_path(os.fspath(path)), arrival_seed, mean_gap_s)
    if _replay_accesses(trace) == 0:  # nothing to replay: every miss ratio would be 0 / 0
        only_writes = " (a step trace's accesses are its reads, and its records only write)" if len(trace.ids) else ""
        raise TraceError(trace.path, None, f"the trace has records but no block accesses{only_writes}")
    return trace


def _folder_path(name: str) -> str:
    """A folder's path ending in its own name, which names the trace (``Trace.info``, and a
    split half's ``#first-half`` is appended to it): ``DIR/``, ``DIR/.`` and ``DIR//./`` (shell
    completion adds the slash) are ``DIR``; a path whose last part is still ``.`` or ``..`` is
    resolved (``os.path.realpath``). Any other path, a file's among them, is kept as given."""
    if not os.path.isdir(name):
        return name
    parts = name.split(os.sep)
    while len(parts) > 1 and parts[-1] in ("", "."):
        parts.pop()
    tidy = os.sep.join(parts) or os.sep
    return os.path.realpath(tidy) if os.path.basename(tidy) in ("", ".", "..") else tidy


def _replay_accesses(trace: Trace) -> int:
    """What a replay counts as accesses: every block of a request trace, the reads of a step
    trace (its writes store new blocks and are not accessed)."""
    return len(trace.ids) if trace.steps is None else int(np.count_nonzero(~trace.steps.is_write))


def _load(name: str, arrival_seed: int, mean_gap_s: float) -> Trace:
    """``load_trace`` without the check for block accesses."""
    refuse_special_file(name)  # before anything opens it: a FIFO would block the first read
    if is_kvtester_workload(name):  # kv-cache-tester conversations: a folder or one .json file
        flat, block_size, fingerprint = load_kvtester_flat(name, arrival_seed, mean_gap_s)
        check_token_counts(name, flat)
        return Trace(name, TraceKind.REQUESTS, fingerprint, flat.ids, _with_end(flat.offsets, flat.ids), requests=flat,
                     block_tokens=block_size)
    fast = _load_requests_bulk(name)
    if fast is not None:
        return fast
    digest = fingerprint_digest()
    objects = iter_json_objects(name, digest)
    first = next(objects, None)
    if first is None:
        raise TraceError(name, None, "no records: the trace is empty")
    kind = kind_of(name, *first)
    if kind is TraceKind.REQUESTS:
        requests = flat_requests(name, itertools.chain([first], objects))
        check_token_counts(name, requests)
        return Trace(name, kind, fingerprint_of(digest), requests.ids, _with_end(requests.offsets, requests.ids), requests=requests,
                     block_tokens=format_block_tokens(request_format(first[1])))
    block_tokens = header_block_tokens(name, *first) if is_header(first[1]) else None
    steps = flat_steps(name, objects if block_tokens else itertools.chain([first], objects))
    return Trace(name, kind, fingerprint_of(digest), steps.ids, _with_end(steps.offsets, steps.ids), steps=steps,
                 block_tokens=block_tokens)


def _load_requests_bulk(name: str) -> Trace | None:
    """A request trace parsed in bulk, one window of lines at a time (``bulkparse.load_requests``:
    ``fastscan`` for the plain form, else orjson), its fingerprint hashed as it is read; None
    defers to the streaming reader (a step trace, anything it would report as an error)."""
    digest = fingerprint_digest()
    try:
        if not os.path.isfile(name):
            return None
        with open(name, "rb") as handle:
            loaded = load_requests(handle, os.fstat(handle.fileno()).st_size, digest)
    except OSError:
        return None  # the streaming reader reports it
    if loaded is None:
        return None
    requests, bailian = loaded
    check_token_counts(name, requests)
    return Trace(name, TraceKind.REQUESTS, fingerprint_of(digest), requests.ids, _with_end(requests.offsets, requests.ids),
                 requests=requests, block_tokens=format_block_tokens("bailian" if bailian else "mooncake"))


def is_kvtester_workload(name: str) -> bool:
    """Whether ``name`` is read as kv-cache-tester conversations: a folder holding ``*.json``
    or ``*.json.gz`` files (any case: ``kvtester.is_conversation_name``), or a file
    ``is_kvtester`` takes whose first line is not a whole request record (a Mooncake JSONL
    file named ``.json`` is not a conversation). Every other trace's fingerprint is the digest
    of its file's bytes (``trace_fingerprint``); a workload's also covers its files' names and
    the arrival seed and gap.

    Raises:
        TraceError: a folder without any such file (empty, or of other files).
    """
    if os.path.isdir(name):
        try:
            files = os.listdir(name)
        except OSError as exc:
            raise TraceError(name, None, f"cannot open trace: {exc.strerror or exc}") from None
        if not any(map(is_conversation_name, files)):
            raise TraceError(name, None, "cannot open trace: a folder with no conversation files (*.json) nor gzipped "
                                         "ones (*.json.gz), in any case")
        return True
    return is_kvtester(name) and not first_line_has_hash_ids(name)


def first_line_has_hash_ids(name: str) -> bool | None:
    """Whether the file's first line alone is a JSON object with ``hash_ids`` (JSON Lines of
    requests; a conversation file's requests sit inside its ``requests`` list; False: an
    object without, a step trace's header or record). None when it is no JSON object or the
    file cannot be read."""
    try:
        with open(name, "rb") as handle:
            record = orjson.loads(handle.readline(MAX_LINE_BYTES + 1))
    except (OSError, orjson.JSONDecodeError):
        return None
    return "hash_ids" in record if isinstance(record, dict) else None


def _with_end(offsets: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return np.append(offsets, np.int64(len(ids)))
