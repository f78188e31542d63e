"""Trace statistics: what ``tiercache trace inspect`` shows, computed from one read of the trace."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from tiercache.policies.base import NO_NEXT_USE
from tiercache.results import TraceKind

from .blockfit import WARN_SHARE, BlockFit, block_fit
from .kvtester import request_origin
from .loader import Trace, is_kvtester_workload, load_trace
from .steptrace import FlatSteps
from .mrc import distance_counts, stack_distances
from .tracelines import record_line
from .traces import next_use

__all__ = ["TraceStats", "trace_stats", "trace_block_fit", "block_fit_warning", "request_source"]

_PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class TraceStats:
    """Summary of a trace, computed from its flat object stream.

    Accesses are what ``tiercache replay`` counts as accesses: every block of a request trace,
    the ``read`` blocks of a step trace. A step trace's ``write`` blocks (``writes``) are stored,
    not accessed: they count in no figure below except ``unique_blocks`` and
    ``blocks_never_read``, and as the previous touch of a block a later read reuses (the
    block is in the cache from its write on). The blocks a recorded run found stored when it
    began (its leading ``resident`` records; ``resident_blocks`` counts them, None on a request
    trace) count as written before the first record.
    ``records`` counts requests (request traces) or step records (step traces).
    ``unique_blocks`` counts the distinct blocks the trace names (read or written).
    ``compulsory_miss_ratio`` = accesses of a block not seen before / accesses: the miss ratio
    of an infinite cache as ``replay`` counts it (unique blocks / accesses on a request trace;
    0 on a step trace that writes every block before reading it). ``prefix_hit_ratio_inf``
    (request traces only) is the hit ratio of an infinite *prefix* cache: a request hits only
    its leading blocks that were all seen before. ``blocks_accessed_once`` is the share of the
    blocks accessed (read) at least once that are accessed exactly once;
    ``accesses_per_block_mean`` = accesses / blocks accessed at least once. Both leave out a
    step trace's blocks that are written and never read, which ``blocks_never_read`` counts
    (None on a request trace, whose every block is accessed); on a request trace the blocks
    accessed are the unique blocks.
    Reuse times count, for each access of a block seen before, the accesses since its previous
    touch (1 for back-to-back accesses); reuse distances count the *distinct* blocks touched in
    between (LRU stack distance: an LRU cache of more blocks than that hits), over the whole
    trace. ``tree_depth_pct`` (request traces) is the depth of each distinct block in the
    prefix tree (0 for a request's first block, at its first sighting) and ``tree_roots`` the
    number of distinct first blocks (sessions, documents, system prompts).
    ``repeat_requests`` (request traces) counts the requests that list a block id more than
    once (no real trace does; they are replayed as listed) and ``first_repeat`` names the
    first one in the trace's order (``file:line``, or ``file requests[i]`` in a kv-cache-tester
    workload; None when there is none). In such a request a repeated id is one block: it counts
    once in ``unique_blocks`` and in ``tree_depth_pct`` (at its first position), each listing is
    an access (``record_blocks_pct``, ``accesses``; a repeat is a reuse at distance 0), and
    ``compulsory_miss_ratio`` counts a repeat as a hit, as object semantics replays it, while
    ``prefix_hit_ratio_inf`` stops at the request's first new block, as prefix semantics does.
    ``record_blocks_pct`` counts the blocks each record names (a step record's reads and writes). ``block_tokens`` is the trace's tokens per block
    (None: a step trace without a header). ``block_mismatches`` (request traces) says how many
    requests list other than ``ceil(input_length / block_tokens)`` ids and the block size their
    lengths imply (``BlockFit.summary``), ``first_block_mismatch`` where the first one is.
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
    repeat_requests: int | None = None
    first_repeat: str | None = None
    blocks_never_read: int | None = None
    block_mismatches: str | None = None
    first_block_mismatch: str | None = None
    resident_blocks: int | None = None


def _pct(values: np.ndarray) -> dict[str, float]:
    """p50/p90/p99/max of an array ({} when empty)."""
    if len(values) == 0:
        return {}
    points = np.percentile(values, _PERCENTILES)
    out = {f"p{p}": float(v) for p, v in zip(_PERCENTILES, points)}
    out["max"] = float(values.max())
    return out


def _pct_of_counts(counts: np.ndarray) -> dict[str, float]:
    """``_pct`` of the values ``v`` repeated ``counts[v]`` times, without making them.

    ``np.percentile`` ('linear') interpolates, at virtual index ``(n - 1) * q``, between the
    order statistics of ranks ``floor`` and ``floor + 1`` (the last one past the end); here
    they are read off the cumulative counts and interpolated by numpy itself, as a pair at
    the same fraction, so every float operation, and the result, is the same.
    """
    cumulative = np.cumsum(counts)
    n = int(cumulative[-1]) if cumulative.size else 0
    if n == 0:
        return {}
    virtual = (n - 1) * np.true_divide(_PERCENTILES, 100)
    below = np.floor(virtual)
    ranks = below.astype(np.int64)
    lower = np.searchsorted(cumulative, ranks, side="right")  # the value of rank r: cumulative[v] > r first
    upper = np.searchsorted(cumulative, np.minimum(ranks + 1, n - 1), side="right")
    points = [np.quantile(np.array([a, b]), [t])[0] for a, b, t in zip(lower, upper, virtual - below)]
    out = {f"p{p}": float(v) for p, v in zip(_PERCENTILES, points)}
    out["max"] = float(np.flatnonzero(counts)[-1])
    return out


def _prefix_hits(ids: np.ndarray, offsets: np.ndarray) -> int:
    """Accesses that hit an infinite prefix cache: per request, the blocks before its first new block."""
    _, first = np.unique(ids, return_index=True)
    first.sort()  # positions of first occurrences, ascending
    ends = np.append(offsets[1:], len(ids))
    nxt = np.searchsorted(first, offsets)  # first new block at or after each request's start
    first_new = np.where(nxt < len(first), first[np.minimum(nxt, len(first) - 1)], len(ids))
    return int((np.minimum(first_new, ends) - offsets).sum())


def _reuse_stats(ids: np.ndarray, is_read: np.ndarray, nu: np.ndarray) -> dict[str, object]:
    """Block-level figures over the accesses (``ids[is_read]``), a write being a touch (see
    ``TraceStats``); ``nu`` is ``next_use(ids)``."""
    blocks, first = np.unique(ids, return_index=True)
    counts = np.bincount(np.searchsorted(blocks, ids[is_read]), minlength=len(blocks))
    counts_read = counts[counts > 0]  # per block accessed; a block only written is not one
    reused = np.flatnonzero(nu != NO_NEXT_USE)
    reused = reused[is_read[nu[reused]]]  # previous touches of a block an access reuses
    reads_so_far = np.cumsum(is_read)
    accesses = int(is_read.sum())
    return {
        "accesses": accesses,
        "unique_blocks": len(blocks),
        "blocks_never_read": len(blocks) - len(counts_read),
        "compulsory_miss_ratio": int(is_read[first].sum()) / accesses if accesses else 0.0,
        "blocks_accessed_once": float(np.mean(counts_read == 1)) if len(counts_read) else 0.0,
        "accesses_per_block_mean": accesses / len(counts_read) if len(counts_read) else 0.0,
        "accesses_per_block_max": int(counts.max()),
        "reuse_time_pct": _pct(reads_so_far[nu[reused]] - reads_so_far[reused]),
    }


def reuse_distances(ids: np.ndarray) -> np.ndarray:
    """LRU reuse distance of every re-access, in access order: the distinct ids touched
    since the id's previous access (0 for back-to-back accesses of one id). One pass over the
    whole of ``ids`` (``mrc.stack_distances``, O(N log N) work)."""
    distances = stack_distances(ids)  # distinct ids in between + 1; 0 for a first access
    reused = distances[distances > 0]
    reused -= 1
    return reused


def _tree_shape(ids: np.ndarray, offsets: np.ndarray) -> tuple[dict[str, float], int]:
    """Depth percentiles of the distinct blocks (at first sighting) and the number of roots."""
    depth = np.arange(len(ids)) - np.repeat(offsets[:-1], np.diff(offsets))
    _, first = np.unique(ids, return_index=True)
    roots = len(np.unique(ids[offsets[:-1][np.diff(offsets) > 0]]))
    return _pct(depth[first]), roots


def _repeat_requests(nu: np.ndarray, offsets: np.ndarray) -> tuple[int, int | None]:
    """Requests that list a block id more than once, and the index of the first (None: none).

    A request repeats an id exactly when some access's next use of its id (``nu``, from
    ``next_use``; ``NO_NEXT_USE`` is past every end) lies before the request's end.
    """
    lengths = np.diff(offsets)
    ends = np.repeat(offsets[1:], lengths)
    owners = np.repeat(np.arange(len(lengths)), lengths)[nu < ends]
    if len(owners) == 0:
        return 0, None
    return len(np.unique(owners)), int(owners.min())


def request_source(path: str, index: int) -> str | None:
    """Where request ``index`` of a request trace is written: ``file:line`` for JSONL, ``file
    requests[i]`` for a kv-cache-tester workload (arrivals as ``load_trace``'s defaults); None
    when the trace, read again, has no such request any more (it changed since the load)."""
    try:
        if is_kvtester_workload(path):
            file, request = request_origin(path, index)
            return f"{file} requests[{request}]"
        return f"{path}:{record_line(path, index)}"
    except IndexError:
        return None


def trace_stats(path: str | os.PathLike | Trace) -> TraceStats:
    """Statistics of a request trace or a step trace (the kind is detected; one read).

    Args:
        path: the trace file or kv-cache-tester folder, or the trace as read already (from
            the trace cache, whose next uses are then used as they are).

    Raises:
        TraceError: the trace is malformed, or has records but no block access (a step
            trace: no read), as ``load_trace`` refuses it.
    """
    trace = path if isinstance(path, Trace) else load_trace(path)
    ids, starts = trace.ids, trace.offsets[:-1]
    if trace.requests is not None:
        flat, writes, is_read = trace.requests, 0, np.ones(len(ids), dtype=bool)
        prefix = _prefix_hits(ids, starts) / len(ids) if len(ids) else 0.0
        tokens = _pct(flat.input_lengths)
        millis = int(flat.timestamps.max()) - int(flat.timestamps.min())  # exact: no float near 2**63
        span = f"{millis // 1000}.{millis % 1000:03d} s"
    else:
        steps, prefix, tokens = trace.steps, None, None
        writes, is_read = int(steps.is_write.sum()), ~steps.is_write
        layers = len(np.unique(steps.layers))
        span = f"steps {steps.steps[0]}..{steps.steps[-1]} ({len(np.unique(steps.steps))} distinct; layers: {layers})"
        resident = _resident_ids(steps)  # stored before the run: touched (written) before the first record
        ids, is_read = np.concatenate((resident, ids)), np.concatenate((np.zeros(len(resident), dtype=bool), is_read))
    nu = trace.next_use if trace.requests is not None and trace.next_use is not None else next_use(ids)
    reuse = _reuse_stats(ids, is_read, nu)
    # Reuse distances of the re-touches that are reads: a write is a touch (the blocks written in
    # between count, and a write may be the previous touch). [1:]: counts[d] = reads at distance d.
    distances = _pct_of_counts(distance_counts(ids, is_read, nu)[1:])
    depth, roots, repeats, first_repeat = None, None, None, None
    if trace.requests is not None:
        depth, roots = _tree_shape(ids, trace.offsets)
        repeats, first = _repeat_requests(nu, trace.offsets)
        first_repeat = None if first is None else request_source(trace.path, first)
    fit = trace_block_fit(trace)
    return TraceStats(
        trace.kind, trace.records, reuse["accesses"], writes, reuse["unique_blocks"], reuse["compulsory_miss_ratio"], prefix,
        reuse["blocks_accessed_once"], reuse["accesses_per_block_mean"], reuse["accesses_per_block_max"],
        reuse["reuse_time_pct"], _pct(np.diff(trace.offsets)), tokens, span, distances, depth, roots, trace.block_tokens,
        repeats, first_repeat, None if trace.requests is not None else reuse["blocks_never_read"],
        None if fit is None else fit.summary(), None if fit is None or fit.first is None else request_source(trace.path, fit.first),
        None if trace.requests is not None else len(resident),
    )  # fmt: skip


def _resident_ids(steps: FlatSteps) -> np.ndarray:
    """The ids a step trace's leading ``resident`` records place, in file order (int64)."""
    placed: list[int] = []
    for fields in (steps.decode or {}).values():
        if not fields.resident:
            break  # resident records lead the trace (``steptrace``)
        for _, ids in fields.resident:
            placed.extend(ids)
    return np.array(placed, dtype=np.int64)


def trace_block_fit(trace: Trace) -> BlockFit | None:
    """How the ``hash_ids`` of a request trace fit its prompts (``blockfit``); None for a step trace."""
    if trace.requests is None or not trace.block_tokens:
        return None
    return block_fit(np.diff(trace.offsets), trace.requests.input_lengths, trace.block_tokens)


def block_fit_warning(trace: Trace) -> str | None:
    """The one warning line ``replay`` prints when more than ``WARN_SHARE`` of a request
    trace's requests list other than ``ceil(input_length / block_tokens)`` ids, else None."""
    fit = trace_block_fit(trace)
    if fit is None or fit.share <= WARN_SHARE:
        return None
    where = request_source(trace.path, fit.first) or f"request {fit.first} (in arrival order)"
    implied = (f" (their lengths imply {fit.implied_block_tokens}-token blocks)"
               if fit.implied_block_tokens not in (None, fit.block_tokens) else "")
    return (f"warning: {where}: {fit.mismatched:,} of {fit.requests:,} requests ({100 * fit.share:.2f}%) list other than "
            f"ceil(input_length / {fit.block_tokens}) hash_ids{implied}; the replay counts {fit.block_tokens} tokens per "
            "block, so their tokens saved and block bytes are off (was the trace hashed with other blocks?)")
