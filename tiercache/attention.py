"""Decode attention over KV blocks spread across tiers: exact (chunked, merged by
log-sum-exp) and sparse (Quest-style block selection).

Exact attention never needs the whole sequence in one place. The blocks are cut into
chunks that fit a bounded window; each chunk gives a partial output and the log-sum-exp of
its scores, and partials merge exactly::

    m = max(lse_a, lse_b)
    out = (exp(lse_a - m) * out_a + exp(lse_b - m) * out_b) / (exp(lse_a - m) + exp(lse_b - m))
    lse = m + log(exp(lse_a - m) + exp(lse_b - m))

``stream_attention`` runs the schedule: the window holds ``depth`` chunk buffers; chunk
``i + 1`` is being fetched (by the caller's ``ChunkSource``: I/O threads for NVMe, a copy
stream on a GPU) while chunk ``i`` computes, and a buffer is handed to the next fetch only
once the chunk in it has been computed.

Sparse attention keeps, per block, the per-channel minimum and maximum of its keys (Quest,
Tang et al. 2024). For a query ``q`` the largest score any key of the block can reach is
``sum_c max(q_c * min_c, q_c * max_c)``; a softmax of those bounds over the blocks estimates
each block's share of a head's attention, blocks are ranked by that share averaged over the
query heads (one block selection serves every head), the first (sink) and most recent blocks
are always kept, and only the top ``budget`` blocks are read.

Shapes: ``q`` is ``[q_heads, 1, head_dim]``; KV for attention is ``[kv_heads, tokens,
head_dim]``; GQA/MQA when ``q_heads`` is a multiple of ``kv_heads`` (query head ``h`` reads
KV head ``h // (q_heads // kv_heads)``). Compute runs in float32 (float64 for float64
inputs), whatever the storage dtype; scores beyond float32's range (bf16 or fp32 KV and
queries near 1e19 and above), and weighted sums of values beyond it (bf16 or fp32 V near
float32's largest values), are computed in float64 instead, so finite 16- or 32-bit inputs
never give NaN or inf.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

__all__ = ["SCORE_BUDGET", "Partial", "partial_attention", "merge", "stream_attention", "stream_partial", "may_overflow",
           "ChunkSource", "dense_reference",
           "compute_dtype", "block_summaries", "block_bounds", "block_scores", "select_blocks"]


#: Scores one ``partial_attention`` call computes at most when the query has many rows (32 Mi:
#: 128 MiB in float32); ``_sliced_partial`` cuts the rows to fit.
SCORE_BUDGET = 1 << 25


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention computes in for KV stored as ``dtype`` (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Partial:
    """Attention of the query over a subset of the keys.

    Invariants: ``out`` is ``[kv_heads, group, head_dim]``, normalised over the subset;
    ``peak`` and ``total`` are ``[kv_heads, group]``: the largest scaled score of the subset
    and the sum of ``exp(score - peak)`` over it, so ``lse = peak + log(total)`` is the
    subset's log-sum-exp (``-inf`` for an empty subset, whose ``out`` is zero). They are kept
    apart because a merge must not round ``log(total)`` away: next to a peak of 1e8 in
    float32 it would be, and keys tied across chunks would lose their count. A row with a
    score that is not finite in the compute dtype (an overflow) has a NaN ``peak``: it must be
    recomputed in float64. ``Partial(out, lse)`` (``total`` left out) is the subset with
    log-sum-exp ``lse``.
    """

    out: torch.Tensor
    peak: torch.Tensor
    total: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.total is None:
            self.total = torch.ones_like(self.peak)

    @property
    def lse(self) -> torch.Tensor:
        """``[kv_heads, group]``: the log-sum-exp of the subset's scaled scores."""
        return self.peak + torch.log(self.total)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[q_heads, 1, D]`` -> ``[kv_heads, group, D]`` (query heads of one KV head together)."""
    q_heads, _, head_dim = q.shape
    return q.reshape(kv_heads, q_heads // kv_heads, head_dim)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                      allowed: torch.Tensor | None = None) -> Partial:
    """Attention of the grouped query over one chunk of keys and values.

    Args:
        q: ``[kv_heads, group, D]`` in the compute dtype.
        k, v: ``[kv_heads, n, D]`` (any float dtype; upcast to ``q``'s dtype); the shapes
            are the caller's to check (``stream_attention`` checks them).
        scale: score scale, ``1/sqrt(D)`` by default.
        allowed: optional ``[group, n]`` bool mask (True: the row may see the key), the same
            for every KV head; every row must allow at least one key (a causal mask over a
            prefill chunk's own keys does).

    Returns:
        The partial; a row whose allowed scores overflow the compute dtype (or hold NaN)
        gets a NaN ``peak``, and one whose weighted sum of values overflows it (V near the
        dtype's largest values) an ``out`` that is not finite (no host synchronisation here:
        the caller tests the merged ``lse`` and ``out`` once).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k.shape[1] == 0:
        return Partial(torch.zeros_like(q), torch.full(q.shape[:2], -math.inf, dtype=q.dtype, device=q.device))
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    scores = torch.matmul(q, k.transpose(1, 2)).mul_(scale)  # [kv_heads, group, n]
    if allowed is None:
        finite = torch.isfinite(scores.amin(dim=-1, keepdim=True))  # every score of the row
    else:
        finite = ~(~torch.isfinite(scores) & allowed).any(dim=-1, keepdim=True)
        scores.masked_fill_(~allowed, -math.inf)
    peak = scores.amax(dim=-1, keepdim=True)
    finite &= torch.isfinite(peak)
    weights = scores.sub_(peak).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights, v).div_(total)
    return Partial(out, torch.where(finite, peak, math.nan).squeeze(-1), total.squeeze(-1))


def merge(a: Partial, b: Partial) -> Partial:
    """The exact attention over the union of two disjoint key subsets (a NaN peak stays NaN,
    and an ``out`` that is not finite stays so). The outputs are combined with weights that
    sum to 1, so finite ones never overflow in the merge (a weighted sum divided afterwards
    did, for values near the dtype's max)."""
    peak = torch.maximum(a.peak, b.peak)
    safe = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    wa = a.total * torch.exp(a.peak - safe)
    wb = b.total * torch.exp(b.peak - safe)
    total = wa + wb
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out = a.out * (wa / denom).unsqueeze(-1) + b.out * (wb / denom).unsqueeze(-1)
    return Partial(out, peak, total)


class ChunkSource(Protocol):
    """Where ``stream_attention`` gets its chunks from (implemented by the decode cache).

    ``start(i, buffer)`` begins bringing chunk ``i`` into window buffer ``buffer`` (in
    ``[0, depth)``) and returns a handle; ``finish(handle)`` waits for it and returns the
    chunk's ``(k, v)``, each ``[kv_heads, tokens, D]``, valid until the buffer is reused.
    A chunk may be started again once finished: ``stream_attention`` reads every chunk a
    second time, in float64, when float32 scores or outputs overflow.

    Optional: ``settle(handle)`` waits for a started chunk without converting it (what a
    failed read drains with; ``finish`` otherwise), and ``stored_dtype``, the dtype the
    chunks are stored in when ``finish`` converts them (the overflow check judges that one).
    """

    def start(self, index: int, buffer: int) -> object: ...

    def finish(self, handle: object) -> tuple[torch.Tensor, torch.Tensor]: ...


def stream_attention(q: torch.Tensor, kv_heads: int, source: ChunkSource, n_chunks: int, depth: int = 2,
                     extra: Sequence[tuple[torch.Tensor, torch.Tensor]] = (), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact decode attention of ``q`` over ``n_chunks`` chunks of ``source`` plus ``extra``
    chunks already in memory (a sequence's partial tail block), merged by log-sum-exp.

    The schedule: the first ``depth`` fetches start at once; then, for each chunk ``i`` in
    order: wait for chunk ``i``, compute it (chunks ``i+1 .. i+depth-1`` are still being
    fetched meanwhile), and only then hand its buffer to chunk ``i + depth``. The window is
    therefore ``depth`` chunk buffers, whatever the sequence length. If a score or a
    weighted sum of values overflowed ``dtype`` (one check of the merged log-sum-exp and
    output, after the last chunk), the whole schedule runs again in float64: finite 16- or
    32-bit inputs never give NaN or inf. The check (one host synchronisation on CUDA) is
    skipped when every input is fp16 or narrower as stored (``ChunkSource.stored_dtype``),
    whose float32 scores and sums cannot overflow.

    A failure (an error, or a Ctrl-C while a fetch is awaited) waits for every fetch whose
    ``finish`` did not complete, the one being finished included, before it propagates: no
    fetch is left to write its window buffer under the next read.

    Returns:
        ``[q_heads, 1, D]`` in ``dtype``.

    Raises:
        ValueError: ``depth`` or ``kv_heads`` below 1; ``q`` not ``[q_heads, 1, D]`` with
            ``q_heads`` a multiple of ``kv_heads``; a chunk whose K and V are not both
            ``[kv_heads, tokens, D]``; no keys in any chunk.
    """
    return stream_partial(q, kv_heads, source, n_chunks, depth, extra, dtype).out.reshape(q.shape).to(dtype)


def stream_partial(q: torch.Tensor, kv_heads: int, source: ChunkSource, n_chunks: int, depth: int = 2,
                   extra: Sequence[tuple[torch.Tensor, torch.Tensor]] = (), dtype: torch.dtype = torch.float32) -> Partial:
    """``stream_attention``'s schedule, returning the merged ``Partial`` (``out`` is
    ``[kv_heads, group, D]``) so that a caller can merge it with attention over keys held
    elsewhere (a prefill chunk's own causal keys). Its ``out``, ``peak`` and ``total`` are in
    ``dtype``, or in float64 when a score or a weighted sum of values overflowed ``dtype``
    (the rerun); ``lse`` and ``out`` are finite for finite inputs.

    Raises:
        ValueError: as ``stream_attention``.
    """
    if depth < 1:
        raise ValueError("stream_attention: depth must be at least 1")
    _check_query(q, kv_heads)
    extras = list(extra)
    result, wide = _streamed(q, kv_heads, source, n_chunks, depth, extras, dtype)
    if wide and dtype != torch.float64 and not _finite(result):  # one host sync
        result, _ = _streamed(q, kv_heads, source, n_chunks, depth, extras, torch.float64)
    return result


def _finite(part: Partial) -> bool:
    """Whether a merged partial's log-sum-exp and output are all finite, with one host
    synchronisation: an overflowed score makes the first NaN or inf, an overflowed weighted
    sum of values (in ``partial_attention``'s product or a ``merge``) the second."""
    return bool(torch.isfinite(part.lse).all() & torch.isfinite(part.out).all())


def may_overflow(*inputs: torch.Tensor | torch.dtype) -> bool:
    """Whether float32 scores, or weighted sums of values, of these inputs (tensors, or the
    dtypes they are stored in) can overflow: some dtype reaches beyond fp16's 65504 (bf16,
    fp32). fp16 (and fp8) inputs cannot: a score is at most ``D x 65504**2`` and a sum at most
    ``tokens x 65504``, so their results need no overflow check (and, on CUDA, no host
    synchronisation)."""
    limit = torch.finfo(torch.float16).max
    return any(torch.finfo(t if isinstance(t, torch.dtype) else t.dtype).max > limit for t in inputs)


def _streamed(q: torch.Tensor, kv_heads: int, source: ChunkSource, n_chunks: int, depth: int,
              extras: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> tuple[Partial, bool]:
    """One run of ``stream_attention``'s schedule in ``dtype``: the merged partial, and whether
    any input ``may_overflow`` (its scores could overflow ``dtype``), judged by the dtype its
    chunks are stored in (``source.stored_dtype``) when the source converts them.

    Invariant: ``in_flight`` holds every started fetch whose ``finish`` has not returned; a
    handle leaves it only once finished, so a failure drains the one being finished too."""
    grouped = _grouped(q.to(dtype), kv_heads)
    result: Partial | None = None
    keys = 0
    wide = may_overflow(q)
    stored = getattr(source, "stored_dtype", None)
    in_flight: deque = deque()
    try:
        in_flight.extend(source.start(i, i % depth) for i in range(min(depth, n_chunks)))
        for index in range(n_chunks):
            k, v = source.finish(in_flight[0])  # a finish that fails leaves its fetch to _drain
            in_flight.popleft()
            keys += _check_chunk(k, v, grouped, f"chunk {index}")
            wide = wide or may_overflow(*((k, v) if stored is None else (stored,)))
            part = _sliced_partial(grouped, k, v)  # compute chunk i while i+1.. are fetched
            result = part if result is None else merge(result, part)
            following = index + depth
            if following < n_chunks:  # its buffer is free only now that chunk i is computed
                in_flight.append(source.start(following, following % depth))
    except BaseException:
        _drain(source, in_flight)
        raise
    for index, (k, v) in enumerate(extras):
        keys += _check_chunk(k, v, grouped, f"extra chunk {index}")
        wide = wide or may_overflow(k, v)
        part = _sliced_partial(grouped, k, v)
        result = part if result is None else merge(result, part)
    if result is None or keys == 0:
        raise ValueError("stream_attention: no keys to attend to")
    return result, wide


def _sliced_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Partial:
    """``partial_attention`` of the grouped query over one chunk, ``SCORE_BUDGET`` scores at
    a time: many query rows (a prefill chunk's tokens over a stored prefix) are cut into
    slices, so the score matrix stays bounded whatever the number of queries; a decode
    step's few rows are one slice."""
    kv_heads, rows = q.shape[:2]
    step = max(1, SCORE_BUDGET // max(1, kv_heads * k.shape[1]))
    if rows <= step:
        return partial_attention(q, k, v)
    parts = [partial_attention(q[:, start : start + step], k, v) for start in range(0, rows, step)]
    return Partial(torch.cat([p.out for p in parts], dim=1), torch.cat([p.peak for p in parts], dim=1),
                   torch.cat([p.total for p in parts], dim=1))


def _drain(source: ChunkSource, in_flight: deque) -> None:
    """Waits for the fetches still in flight after a failure (their own errors are the
    failure's consequence), the one whose ``finish`` failed included (its other pieces may
    still be landing): a fetch left running would write its window buffer under the next
    read. A source with ``settle(handle)`` (wait without converting) is asked that, others
    ``finish``."""
    settle = getattr(source, "settle", source.finish)
    while in_flight:
        try:
            settle(in_flight.popleft())
        except BaseException:  # noqa: BLE001 - the first failure is the one raised
            pass


def _check_query(q: torch.Tensor, kv_heads: int) -> None:
    """Raises ValueError unless ``kv_heads >= 1`` and ``q`` is ``[q_heads, 1, D]`` with
    ``q_heads`` a positive multiple of ``kv_heads``."""
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, numbers.Integral) or kv_heads < 1:
        raise ValueError(f"stream_attention: kv_heads must be a positive integer, got {kv_heads!r}")
    if q.dim() != 3 or q.shape[1] != 1 or q.shape[0] < 1 or q.shape[0] % kv_heads:
        raise ValueError(f"stream_attention: q must be [q_heads (a multiple of kv_heads={kv_heads}), 1, head_dim], "
                         f"got {tuple(q.shape)}")


def _check_chunk(k: torch.Tensor, v: torch.Tensor, grouped: torch.Tensor, where: str) -> int:
    """The number of keys of a chunk, after checking that K and V are both ``[kv_heads,
    tokens, D]`` for the grouped query ``[kv_heads, group, D]`` (torch would broadcast a
    single head silently). Raises ValueError naming ``where``."""
    kv_heads, _, head_dim = grouped.shape
    if k.dim() != 3 or k.shape != v.shape or k.shape[0] != kv_heads or k.shape[2] != head_dim:
        raise ValueError(f"stream_attention: {where}: k and v must both be [kv_heads={kv_heads}, tokens, head_dim={head_dim}], "
                         f"got k {tuple(k.shape)} and v {tuple(v.shape)}")
    return k.shape[1]


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain softmax attention in float64 (the correctness reference).

    Args:
        q: ``[q_heads, 1, D]``; k, v: ``[kv_heads, n, D]``.
    """
    kv_heads = k.shape[0]
    grouped = _grouped(q.double(), kv_heads)
    scores = torch.matmul(grouped, k.double().transpose(1, 2)) / math.sqrt(q.shape[-1])
    out = torch.matmul(torch.softmax(scores, dim=-1), v.double())
    return out.reshape(q.shape)


# -- sparse selection ---------------------------------------------------------------------
def block_summaries(k_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block, per-head, per-channel key minimum and maximum (float32).

    Args:
        k_blocks: ``[blocks, kv_heads, tokens, D]``.

    Returns:
        ``(kmin, kmax)``, each ``[blocks, kv_heads, D]``.
    """
    return k_blocks.amin(dim=2).float(), k_blocks.amax(dim=2).float()


def block_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Each block's estimated share of the query's attention mass, as a log, one number per
    block (one selection serves every head).

    Per query head, the block's bound ``sum_c max(q_c * min_c, q_c * max_c) / sqrt(D)``
    (``block_bounds``) stands for the log-weight of its keys, so a softmax of the bounds over
    the blocks estimates the share of that head's attention each block holds. A block's score
    is the log of that share averaged over every query head (of every KV head): the top
    ``k`` blocks by score are then the ones that keep the most attention mass per head on
    average, by the estimate. A head with diffuse attention (a small or aimless query)
    spreads its shares evenly, so it adds about the same to every block and leaves the
    ranking to the heads whose output depends on it (normalising each head by its best block
    instead gave every block about 0 through such a head, which outranked the focused heads'
    second-tier blocks: probe Q25).

    Args:
        q: ``[q_heads, 1, D]``; kmin, kmax: ``[blocks, kv_heads, D]``.

    Returns:
        ``[blocks]`` float32 scores, each at most 0 up to rounding (the log of a share; the
        shares sum to 1 over the blocks), ``-inf`` for a block whose log-share lies below
        float32's range (bounds beyond it, computed in float64: its keys weigh nothing); NaN
        only from inputs that are not finite.
        Cost: two log-sum-exps over the ``[kv_heads, blocks, group]`` bounds on top of
        ``block_bounds``, which dominates.
    """
    bound = block_bounds(q, kmin, kmax)  # [kv, blocks, g]
    share = bound - torch.logsumexp(bound, dim=1, keepdim=True)  # log of each head's share per block
    heads = share.transpose(0, 1).reshape(share.shape[1], -1)  # [blocks, q_heads]: a contiguous reduction
    return (torch.logsumexp(heads, dim=1) - math.log(heads.shape[1])).float()


def block_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Per KV head, block and query head: an upper bound on ``q.k / sqrt(D)`` over the keys
    ``k`` of the block, ``sum_c max(q_c * min_c, q_c * max_c) / sqrt(D)``.

    It is a true upper bound on every key's exact score, rounding included: the sum is
    raised by ``(D + 8) * eps * sum_c |q_c| max(|min_c|, |max_c|) / sqrt(D)`` (over twice
    the worst rounding error of a ``D``-term dot product in any summation order, ``eps``
    the compute dtype's machine epsilon) and by ``(D + 1) * tiny`` (underflow, flushed
    subnormals included). It is computed in float32; where float32 overflows (scores near
    3e38 and beyond), in float64. Assumes IEEE matmuls (not TF32).

    Returns:
        ``[kv_heads, blocks, group]``: float32, or float64 where float32 overflowed.
    """
    bound = _bounds_in(q, kmin, kmax, torch.float32)
    if not bool(torch.isfinite(bound).all()):
        bound = _bounds_in(q, kmin, kmax, torch.float64)
    return bound


def _bounds_in(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``block_bounds`` computed in ``dtype`` (see there for the rounding slack)."""
    _, kv_heads, head_dim = kmin.shape
    info = torch.finfo(dtype)
    qt = _grouped(q.to(dtype), kv_heads).permute(0, 2, 1)  # [kv, D, g]
    magnitude = qt.abs()
    kmin, kmax = kmin.to(dtype), kmax.to(dtype)
    centre = (kmax + kmin).transpose(0, 1)  # [kv, blocks, D]
    spread = (kmax - kmin).transpose(0, 1)
    # max(q_c min_c, q_c max_c) = (q_c (min_c + max_c) + |q_c| (max_c - min_c)) / 2, and
    # |min_c + max_c| + (max_c - min_c) = 2 max(|min_c|, |max_c|)
    mid = torch.matmul(centre, qt)  # [kv, blocks, g]
    reach = torch.matmul(spread, magnitude)
    slack = torch.matmul(centre.abs_(), magnitude).add_(reach).mul_((head_dim + 8) * info.eps)
    return mid.add_(reach).add_(slack).mul_(0.5 / math.sqrt(head_dim)).add_((head_dim + 1) * info.tiny)


def select_blocks(scores: torch.Tensor, budget: int, sink: int = 1, recent: int = 1,
                  spare: int = 0) -> tuple[list[int], list[int]]:
    """Chooses the blocks a sparse step reads, and the ones ranked right after them.

    Args:
        scores: ``[blocks]`` from ``block_scores``.
        budget: blocks to read (an integer, at least 1); the ``sink`` first and ``recent``
            last blocks are always among them (as many as the budget allows).
        spare: how many of the next-ranked blocks to return as candidates (what a
            speculative prefetch may bring up for the next step).

    Returns:
        ``(selected, candidates)``: block indices in ascending order, and candidate indices
        in rank order. ``selected`` holds ``min(budget, blocks)`` distinct indices and no
        candidate is among them, whatever the scores (``-inf`` and NaN included): the
        always-kept blocks are left out of the ranking by index, not by a score. Cost: one
        top-k over the scores; the rest is proportional to ``budget + spare``.

    Raises:
        TypeError: ``budget`` is not an integer (a bool is not); ValueError: below 1.
    """
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
        raise TypeError(f"select_blocks: budget must be an integer block count, got {budget!r}")
    if budget < 1:
        raise ValueError("select_blocks: budget must be at least one block")
    n, budget = scores.shape[0], int(budget)
    if budget >= n:
        return list(range(n)), []
    fixed = sorted(set(range(min(sink, n))) | set(range(max(0, n - recent), n)))[:budget]
    wanted = min(n - len(fixed), budget - len(fixed) + spare)
    # the fixed blocks may rank anywhere: take as many more, then drop them by index
    ranked = torch.topk(scores, wanted + len(fixed)).indices.tolist() if wanted > 0 else []
    kept = set(fixed)
    top = [index for index in ranked if index not in kept][:wanted]
    chosen = budget - len(fixed)
    return sorted(fixed + top[:chosen]), top[chosen:]
