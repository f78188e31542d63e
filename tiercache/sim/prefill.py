"""Prefill compute model: the FLOPs and seconds of computing prompt tokens, attention included.

Computing prompt tokens ``[c, n)`` of a request whose first ``c`` tokens come from the cache
costs ``2 P (n - c) + 4 L H d * sum_{t=c}^{n-1} (t + 1)`` FLOPs: the weights (``2 P`` per
token, ``P`` the model's parameter count) plus attention, ``QK^T`` and ``AV`` of each causal
query over its prefix (``4 L H d`` per query-key pair: ``L`` layers, ``H`` query heads, ``d``
the head dim). The sum is the pairs ``(n (n + 1) - c (c + 1)) / 2`` (``causal_pairs``). Time is
FLOPs / ``F``, the machine's effective FLOP rate: ``F = prefill_tokens_per_s * 2 * P_ref``
(``HardwareProfile.prefill_flops_per_s``), the profile's rate being the reference model's on
short prompts, where attention is negligible.

A request's TTFT saved by ``c`` cached tokens is ``time(0, n) - time(c, n)``, the time of
prefilling its first ``c`` tokens from scratch (it does not depend on ``n``), minus its loads.

A layout without ``params`` (a custom ``--layout`` without ``params=``) is charged the
reference model's weight FLOPs; one without ``heads`` (query heads; ``heads=``) has no
attention term. Left out: attention kernels running at another efficiency than the matmuls,
sliding-window attention, and every decode-phase cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .hardware import REFERENCE_PARAMS, HardwareProfile

__all__ = ["PrefillCost", "causal_pairs", "mean_read_index"]


@dataclass(frozen=True)
class PrefillCost:
    """The prefill FLOPs of one model on one machine.

    Invariants: ``weight_flops`` (per token, ``2 P``) > 0; ``pair_flops`` (per query-key pair,
    ``4 L H d``) >= 0, 0 when the query heads are unknown; ``flops_per_s`` > 0.
    """

    weight_flops: int
    pair_flops: int
    flops_per_s: float

    @classmethod
    def of(cls, profile: HardwareProfile, layout: Any) -> "PrefillCost":
        """The cost of ``layout``'s model on ``profile`` (``params`` None: the reference model's
        weights; ``heads`` None: no attention term).

        Raises:
            UserError: the profile has no prefill speed.
        """
        params = getattr(layout, "params", None) or REFERENCE_PARAMS
        heads = getattr(layout, "heads", None)
        pairs = 0 if heads is None else 4 * layout.layers * heads * layout.head_dim
        return cls(2 * params, pairs, profile.prefill_flops_per_s)

    def seconds(self, tokens: float, pairs: float) -> float:
        """Time to compute ``tokens`` prompt tokens whose queries attend ``pairs`` query-key pairs in all."""
        return (self.weight_flops * tokens + self.pair_flops * pairs) / self.flops_per_s

    def block_seconds(self, blocks: float, block_tokens: int, mean_index: float, layers: int = 1) -> float:
        """Time to recompute ``blocks`` blocks of ``block_tokens`` tokens standing, on average, as
        block ``mean_index`` of their sequence (block ``i`` holds tokens ``[i B, (i + 1) B)``,
        ``B * (i B + (B + 1) / 2)`` pairs); divided by ``layers`` for a per-layer block (one
        layer's share of the model's prefill)."""
        pairs = block_tokens * (block_tokens * mean_index + (block_tokens + 1) / 2)
        return self.seconds(blocks * block_tokens, blocks * pairs) / layers


def causal_pairs(end: np.ndarray, start: np.ndarray | int = 0) -> float:
    """Query-key pairs of computing tokens ``[start, end)`` of each request, summed:
    ``sum (end (end + 1) - start (start + 1)) / 2``. In float64, each term and the sum exact
    while below 2**53 (a request of up to ~9.4e7 tokens, the trace's pairs up to ~9e15)."""
    end = np.asarray(end, dtype=np.float64)
    start = np.asarray(start, dtype=np.float64)
    return float(np.sum(end * (end + 1) / 2 - start * (start + 1) / 2))


def mean_read_index(offsets: np.ndarray, is_write: np.ndarray | None) -> float:
    """Mean index, within its batch, of a block a batch reads (a request's ``i``-th block, a
    step record's ``i``-th read; a record lists its reads before its writes): where, on
    average, a block a miss recomputes stands in its sequence. 0 for a trace without reads.

    Per batch, not per access: a batch of ``r`` reads holds indices ``0 .. r - 1``, summing to
    ``r (r - 1) / 2``, so the mean is ``sum r (r - 1) / 2 / sum r``, exact in int64 and the same
    float as the mean over every read's index (both sums exact below 2**53). Temporaries are a
    few int64 per batch; ``is_write`` (aligned with ``offsets[0] .. offsets[-1]``) is read in
    place, one pass.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    reads = np.diff(offsets)
    if is_write is not None:
        reads = reads - _writes_per_batch(offsets, np.asarray(is_write, dtype=bool))
    total = int(reads.sum())
    return float(int((reads * (reads - 1) // 2).sum())) / total if total else 0.0


def _writes_per_batch(offsets: np.ndarray, is_write: np.ndarray) -> np.ndarray:
    """How many accesses of each batch are writes (0 for an empty batch)."""
    counts = np.diff(offsets)
    writes = np.zeros(len(counts), dtype=np.int64)
    nonempty = np.flatnonzero(counts)
    if len(nonempty):
        starts = offsets[:-1][nonempty] - offsets[0]
        writes[nonempty] = np.add.reduceat(is_write.view(np.uint8), starts, dtype=np.int64)
    return writes
