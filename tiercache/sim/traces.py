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
import os
import stat
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
import xxhash

from tiercache.errors import TraceError
from tiercache.policies.base import NO_NEXT_USE
from tiercache.results import TraceKind
from tiercache.results.outfile import replace_file_with
from tiercache.results.records import FINGERPRINT_PREFIX, legacy_fingerprint
from tiercache.sim.stackdist import next_positions, sorted_next_positions

from .tracelines import (MAX_LINE_BYTES, MAX_TOKENS, MAX_TOTAL_TOKENS, _TOKEN_FIELDS, check_token_counts,
                         first_long_line, id_list_field, int_field, iter_json_objects, seconds_field_ms, token_field)

__all__ = [
    "refuse_special_file",
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
    "half_fingerprint",
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


def request_format(first: dict[str, Any]) -> str:
    """``"bailian"`` when a request trace's first record names its chat and parent chat
    (Alibaba's Bailian traces: seconds, 16-token blocks), else ``"mooncake"``."""
    return "bailian" if "chat_id" in first and "parent_chat_id" in first else "mooncake"


def format_block_tokens(fmt: str) -> int:
    """Tokens per ``hash_ids`` block of a request-trace format (``request_format``)."""
    return BAILIAN_BLOCK_TOKENS if fmt == "bailian" else MOONCAKE_BLOCK_TOKENS


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

    Integer ids take ``stackdist.next_positions`` (one compiled O(n) pass with numba, one
    stable argsort without); other ids its argsort (``sorted_next_positions``).

    Invariants of the result ``nu`` (int64): ``nu[i] > i``; ``ids[nu[i]] == ids[i]`` where
    ``nu[i] != NO_NEXT_USE``; no access of ``ids[i]`` lies strictly between ``i`` and ``nu[i]``.
    """
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"next_use: ids must be 1-D, got shape {ids.shape}")
    if ids.dtype.kind in "iu":  # uint64 ids wrap to int64 one to one: equal stays equal
        following = next_positions(ids.astype(np.int64, copy=False))
    else:
        following = sorted_next_positions(ids)
    result = following.astype(np.int64)
    result[following < 0] = NO_NEXT_USE
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


def half_fingerprint(whole: str, name: str) -> str:
    """The fingerprint of the half ``name`` (``results.SPLIT_HALVES``) of the trace whose
    fingerprint is ``whole`` (``sim.split``): the xxh3-128 of ``whole#name``."""
    digest = fingerprint_digest()
    digest.update(f"{whole}#{name}".encode())
    return fingerprint_of(digest)


def refuse_special_file(name: str) -> None:
    """Refuses a trace path that names a device, FIFO or socket, before anything opens it
    (reading one would block forever or never end). A missing path, a regular file and a
    folder pass: their readers say what is wrong with them.

    Raises:
        TraceError: ``name`` is neither a regular file nor a folder.
    """
    try:
        mode = os.stat(name).st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise TraceError(name, None, "cannot open trace: not a regular file (a device, FIFO or socket)")


def trace_fingerprint(path: str | os.PathLike, like: str | None = None) -> str:
    """The fingerprint of the file's bytes (``xxh3-128:<hex>``), streamed in 1 MiB chunks; with
    ``like`` a legacy fingerprint, the blake2b-128 hex digest earlier versions recorded, so a
    result written by one can still be matched to its trace.

    Identifies the exact trace a result came from (reports record it next to results).

    Raises:
        TraceError: the file cannot be read.
    """
    name = os.fspath(path)
    refuse_special_file(name)
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
    """Writes one JSON text per line; returns the number written. The file is replaced whole:
    a write that fails part-way leaves an earlier file as it was (``outfile.replace_file_with``).

    Raises:
        UserError: the file cannot be written (the message names it and ``what`` it is).
    """

    def write(name: str) -> int:
        count = 0
        with open(name, "w", encoding="utf-8") as handle:
            for line in lines:
                handle.write(line + "\n")
                count += 1
        return count

    return replace_file_with(path, write, f"{os.fspath(path)} ({what})")


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
