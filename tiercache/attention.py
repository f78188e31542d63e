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
``sum_c max(q_c * min_c, q_c * max_c)``; blocks are ranked by that upper bound (per head,
relative to the head's best block, then the maximum over heads, so one block selection
serves every head), the first (sink) and most recent blocks are always kept, and only the
top ``budget`` blocks are read.

Shapes: ``q`` is ``[q_heads, 1, head_dim]``; KV for attention is ``[kv_heads, tokens,
head_dim]``; GQA/MQA when ``q_heads`` is a multiple of ``kv_heads`` (query head ``h`` reads
KV head ``h // (q_heads // kv_heads)``). Compute runs in float32 (float64 for float64
inputs), whatever the storage dtype.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

__all__ = ["Partial", "partial_attention", "merge", "stream_attention", "ChunkSource", "dense_reference",
           "compute_dtype", "block_summaries", "block_bounds", "block_scores", "select_blocks"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention computes in for KV stored as ``dtype`` (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Partial:
    """Attention of the query over a subset of the keys.

    Invariants: ``out`` is ``[kv_heads, group, head_dim]``, normalised over the subset;
    ``lse`` is ``[kv_heads, group]``, the log-sum-exp of the subset's scaled scores (``-inf``
    for an empty subset, whose ``out`` is zero).
    """

    out: torch.Tensor
    lse: torch.Tensor


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[q_heads, 1, D]`` -> ``[kv_heads, group, D]`` (query heads of one KV head together)."""
    q_heads, _, head_dim = q.shape
    return q.reshape(kv_heads, q_heads // kv_heads, head_dim)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> Partial:
    """Attention of the grouped query over one chunk of keys and values.

    Args:
        q: ``[kv_heads, group, D]`` in the compute dtype.
        k, v: ``[kv_heads, n, D]`` (any float dtype; upcast to ``q``'s dtype).
        scale: score scale, ``1/sqrt(D)`` by default.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k.shape[1] == 0:
        return Partial(torch.zeros_like(q), torch.full(q.shape[:2], -math.inf, dtype=q.dtype, device=q.device))
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    scores = torch.matmul(q, k.transpose(1, 2)).mul_(scale)  # [kv_heads, group, n]
    peak = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(peak).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights, v).div_(total)
    return Partial(out, (peak + total.log()).squeeze(-1))


def merge(a: Partial, b: Partial) -> Partial:
    """The exact attention over the union of two disjoint key subsets."""
    peak = torch.maximum(a.lse, b.lse)
    safe = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    wa = torch.exp(a.lse - safe)
    wb = torch.exp(b.lse - safe)
    total = wa + wb
    denom = torch.where(total > 0, total, torch.ones_like(total))
    out = (a.out * wa.unsqueeze(-1) + b.out * wb.unsqueeze(-1)) / denom.unsqueeze(-1)
    return Partial(out, safe + torch.log(total))


class ChunkSource(Protocol):
    """Where ``stream_attention`` gets its chunks from (implemented by the decode cache).

    ``start(i, buffer)`` begins bringing chunk ``i`` into window buffer ``buffer`` (in
    ``[0, depth)``) and returns a handle; ``finish(handle)`` waits for it and returns the
    chunk's ``(k, v)``, each ``[kv_heads, tokens, D]``, valid until the buffer is reused.
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
    therefore ``depth`` chunk buffers, whatever the sequence length.

    Returns:
        ``[q_heads, 1, D]`` in ``dtype``.
    """
    if depth < 1:
        raise ValueError("stream_attention: depth must be at least 1")
    grouped = _grouped(q.to(dtype), kv_heads)
    result: Partial | None = None
    in_flight: deque = deque(source.start(i, i % depth) for i in range(min(depth, n_chunks)))
    extras = list(extra)
    for index in range(n_chunks):
        k, v = source.finish(in_flight.popleft())
        part = partial_attention(grouped, k, v)  # compute chunk i while i+1.. are fetched
        result = part if result is None else merge(result, part)
        following = index + depth
        if following < n_chunks:  # its buffer is free only now that chunk i is computed
            in_flight.append(source.start(following, following % depth))
    for k, v in extras:
        part = partial_attention(grouped, k, v)
        result = part if result is None else merge(result, part)
    if result is None:
        raise ValueError("stream_attention: no keys to attend to")
    return result.out.reshape(q.shape).to(dtype)


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
    """Each block's upper bound on any key's score, one number per block.

    Per query head the bound is ``sum_c max(q_c * min_c, q_c * max_c) / sqrt(D)``; it is taken
    relative to the head's best block (a bound in log-weight units), and a block's score is
    the maximum over heads, so a block that matters to any head ranks high.

    Args:
        q: ``[q_heads, 1, D]``; kmin, kmax: ``[blocks, kv_heads, D]``.

    Returns:
        ``[blocks]`` float32 scores.
    """
    bound = block_bounds(q, kmin, kmax)
    bound = bound - bound.amax(dim=1, keepdim=True)
    return bound.amax(dim=2).amax(dim=0)


def block_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Per KV head, block and query head: ``max over keys k in the block of q.k / sqrt(D)``
    bounded from above by ``sum_c max(q_c * min_c, q_c * max_c) / sqrt(D)``.

    Returns:
        ``[kv_heads, blocks, group]`` float32.
    """
    _, kv_heads, head_dim = kmin.shape
    qt = _grouped(q.float(), kv_heads).permute(0, 2, 1)  # [kv, D, g]
    # max(q_c min_c, q_c max_c) = (q_c (min_c + max_c) + |q_c| (max_c - min_c)) / 2
    mid = torch.matmul((kmax + kmin).transpose(0, 1), qt)  # [kv, blocks, g]
    spread = torch.matmul((kmax - kmin).transpose(0, 1), qt.abs())
    return (mid + spread).mul_(0.5 / math.sqrt(head_dim))


def select_blocks(scores: torch.Tensor, budget: int, sink: int = 1, recent: int = 1,
                  spare: int = 0) -> tuple[list[int], list[int]]:
    """Chooses the blocks a sparse step reads, and the ones ranked right after them.

    Args:
        scores: ``[blocks]`` from ``block_scores``.
        budget: blocks to read (at least 1); the ``sink`` first and ``recent`` last blocks
            are always among them (as many as the budget allows).
        spare: how many of the next-ranked blocks to return as candidates (what a
            speculative prefetch may bring up for the next step).

    Returns:
        ``(selected, candidates)``: block indices in ascending order, and candidate indices
        in rank order. Cost: one top-k over the scores; the rest is proportional to
        ``budget + spare``.
    """
    n = scores.shape[0]
    if budget < 1:
        raise ValueError("select_blocks: budget must be at least one block")
    if budget >= n:
        return list(range(n)), []
    fixed = sorted(set(range(min(sink, n))) | set(range(max(0, n - recent), n)))[:budget]
    ranked = scores.clone()
    if fixed:
        ranked[torch.tensor(fixed, dtype=torch.long, device=scores.device)] = -math.inf
    wanted = min(n - len(fixed), budget - len(fixed) + spare)
    top = torch.topk(ranked, wanted).indices.tolist() if wanted > 0 else []
    chosen = budget - len(fixed)
    return sorted(fixed + top[:chosen]), top[chosen:]
