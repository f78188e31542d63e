"""Trace statistics: what ``tiercache trace inspect`` shows, computed from one read of the trace."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from tiercache.errors import UserError
from tiercache.policies.base import NO_NEXT_USE
from tiercache.results import TraceKind

from .loader import load_trace
from .traces import next_use

__all__ = ["TraceStats", "trace_stats"]

_PERCENTILES = (50, 90, 99)
#: Reuse distances are computed over at most this many leading accesses (a Python loop).
REUSE_DISTANCE_LIMIT = 2_000_000


@dataclass(frozen=True)
class TraceStats:
    """Summary of a trace, computed from its flat object stream.

    ``records`` counts requests (request traces) or step records (step traces).
    ``compulsory_miss_ratio`` = unique blocks / accesses (the miss ratio of an infinite
    cache). ``prefix_hit_ratio_inf`` (request traces only) is the hit ratio of an infinite
    *prefix* cache: a request hits only its leading blocks that were all seen before.
    Reuse times count accesses between an access and the next access of the same block;
    reuse distances count the *distinct* blocks in between (LRU stack distance: an LRU cache of
    more blocks than that hits), over the first ``REUSE_DISTANCE_LIMIT`` accesses.
    ``tree_depth_pct`` (request traces) is the depth of each distinct block in the prefix tree
    (0 for a request's first block, at its first sighting) and ``tree_roots`` the number of
    distinct first blocks (sessions, documents, system prompts). ``block_tokens`` is the trace's
    tokens per block (None: a step trace without a header).
    Percentile maps hold ``p50``/``p90``/``p99``/``max`` (empty when there is nothing to count).
    """

    kind: TraceKind
    records: int
    accesses: int
    writes: int
    unique_blocks: int
    compulsory_miss_ratio: float
    prefix_hit_ratio_inf: float | None
    blocks_accessed_once: float
    accesses_per_block_mean: float
    accesses_per_block_max: int
    reuse_time_pct: dict[str, float]
    record_blocks_pct: dict[str, float]
    input_tokens_pct: dict[str, float] | None
    time_span: str
    reuse_distance_pct: dict[str, float] | None = None
    tree_depth_pct: dict[str, float] | None = None
    tree_roots: int | None = None
    block_tokens: int | None = None


def _pct(values: np.ndarray) -> dict[str, float]:
    """p50/p90/p99/max of an array ({} when empty)."""
    if len(values) == 0:
        return {}
    points = np.percentile(values, _PERCENTILES)
    out = {f"p{p}": float(v) for p, v in zip(_PERCENTILES, points)}
    out["max"] = float(values.max())
    return out


def _prefix_hits(ids: np.ndarray, offsets: np.ndarray) -> int:
    """Accesses that hit an infinite prefix cache: per request, the blocks before its first new block."""
    _, first = np.unique(ids, return_index=True)
    first.sort()  # positions of first occurrences, ascending
    ends = np.append(offsets[1:], len(ids))
    nxt = np.searchsorted(first, offsets)  # first new block at or after each request's start
    first_new = np.where(nxt < len(first), first[np.minimum(nxt, len(first) - 1)], len(ids))
    return int((np.minimum(first_new, ends) - offsets).sum())


def _reuse_stats(ids: np.ndarray) -> dict[str, object]:
    """Block-level reuse: counts per block and reuse times."""
    _, counts = np.unique(ids, return_counts=True)
    nu = next_use(ids)
    has_next = nu != NO_NEXT_USE
    gaps = nu[has_next] - np.flatnonzero(has_next)
    return {
        "unique_blocks": len(counts),
        "blocks_accessed_once": float(np.mean(counts == 1)),
        "accesses_per_block_mean": float(counts.mean()),
        "accesses_per_block_max": int(counts.max()),
        "reuse_time_pct": _pct(gaps),
    }


def reuse_distances(ids: np.ndarray) -> np.ndarray:
    """LRU stack distance of every re-access: distinct ids touched since the id's last access.

    A Fenwick tree over positions marks each id's latest access; the distance of a re-access
    at ``t`` whose previous access was at ``p`` is the number of marks in ``(p, t)``.
    """
    n = len(ids)
    tree = [0] * (n + 1)
    last: dict[int, int] = {}
    out = []

    def add(pos: int, delta: int) -> None:
        pos += 1
        while pos <= n:
            tree[pos] += delta
            pos += pos & -pos

    def prefix(pos: int) -> int:  # marks at positions < pos
        total = 0
        while pos > 0:
            total += tree[pos]
            pos -= pos & -pos
        return total

    for t, block_id in enumerate(ids.tolist()):
        p = last.get(block_id)
        if p is not None:
            out.append(prefix(t) - prefix(p + 1))
            add(p, -1)
        add(t, 1)
        last[block_id] = t
    return np.array(out, dtype=np.int64)


def _tree_shape(ids: np.ndarray, offsets: np.ndarray) -> tuple[dict[str, float], int]:
    """Depth percentiles of the distinct blocks (at first sighting) and the number of roots."""
    depth = np.arange(len(ids)) - np.repeat(offsets[:-1], np.diff(offsets))
    _, first = np.unique(ids, return_index=True)
    roots = len(np.unique(ids[offsets[:-1][np.diff(offsets) > 0]]))
    return _pct(depth[first]), roots


def trace_stats(path: str | os.PathLike) -> TraceStats:
    """Statistics of a request trace or a step trace (the kind is detected; one read).

    Raises:
        TraceError: the trace is malformed.
        UserError: the trace has records but no block access.
    """
    trace = load_trace(path)
    ids, starts = trace.ids, trace.offsets[:-1]
    if trace.requests is not None:
        flat, writes = trace.requests, 0
        prefix = _prefix_hits(ids, starts) / len(ids) if len(ids) else 0.0
        tokens = _pct(flat.input_lengths)
        span = f"{(flat.timestamps.max() - flat.timestamps.min()) / 1000:.3f} s"
    else:
        steps, prefix, tokens = trace.steps, None, None
        writes = int(steps.is_write.sum())
        layers = len(np.unique(steps.layers))
        span = f"steps {steps.steps[0]}..{steps.steps[-1]} ({len(np.unique(steps.steps))} distinct; layers: {layers})"
    if len(ids) == 0:
        raise UserError(f"{os.fspath(path)}: the trace has records but no block accesses")
    reuse = _reuse_stats(ids)
    distances = _pct(reuse_distances(ids[:REUSE_DISTANCE_LIMIT]))
    depth, roots = _tree_shape(ids, trace.offsets) if trace.requests is not None else (None, None)
    return TraceStats(
        trace.kind, trace.records, len(ids), writes, reuse["unique_blocks"], reuse["unique_blocks"] / len(ids), prefix,
        reuse["blocks_accessed_once"], reuse["accesses_per_block_mean"], reuse["accesses_per_block_max"],
        reuse["reuse_time_pct"], _pct(np.diff(trace.offsets)), tokens, span, distances, depth, roots, trace.block_tokens,
    )  # fmt: skip
