"""The blocks a ``Sequence``'s read uses: a sparse step's selection and its prefetch
candidates, and the next layer's first reads (what ``layer_ahead`` brings up).

A sparse step always reads the sink and recent blocks (``TieredKVCache(sink_blocks=...,
recent_blocks=...)``): a budget below them is raised to them, so the blocks ``sparse_positions``
reads always contain the ones ``ahead_ids`` prefetched for that layer.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence as Seq

import numpy as np
import torch

from tiercache.attention import block_scores, select_blocks
from tiercache.config import AttentionMode

from .layerstate import LayerState

if TYPE_CHECKING:
    from .cache import TieredKVCache

__all__ = ["always_read", "read_budget", "sparse_positions", "ahead_ids"]


def always_read(cache: TieredKVCache, n: int) -> list[int]:
    """Positions of ``n`` blocks a sparse step always reads, ascending: the first
    ``sink_blocks`` and the last ``recent_blocks`` (all ``n`` when they overlap)."""
    return sorted(set(range(min(cache.sink_blocks, n))) | set(range(max(0, n - cache.recent_blocks), n)))


def read_budget(cache: TieredKVCache, count: int, n: int) -> int:
    """The blocks a sparse step of ``n`` blocks reads for a budget of ``count``: at least the
    sink and recent blocks (``min(n, sink_blocks + recent_blocks)``), so a budget of one
    block (or a share rounding to one) still reads the newest block as well as the first."""
    return max(count, min(n, cache.sink_blocks + cache.recent_blocks))


def sparse_positions(cache: TieredKVCache, state: LayerState, q: torch.Tensor, count: int) -> tuple[np.ndarray, list[int]]:
    """Block positions a sparse step reads (ascending; ``read_budget`` of them, at most
    ``state.n``) and the ids of the next-ranked candidates, ``ceil(speculate x`` the blocks
    read``)`` of them (none for ``speculate=0``), for ``topk_speculative``."""
    if state.n == 0:
        return np.zeros(0, dtype=np.int64), []
    budget = read_budget(cache, count, state.n)
    scores = block_scores(q, state.kmin[: state.n], state.kmax[: state.n])
    selected, spare = select_blocks(scores, budget, cache.sink_blocks, cache.recent_blocks,
                                    spare=math.ceil(cache.speculate * budget))
    return np.asarray(selected, dtype=np.int64), [int(state.ids[p]) for p in spare]


def ahead_ids(cache: TieredKVCache, layers: Seq[LayerState], layer: int, mode: AttentionMode) -> list[int]:
    """Ids the next layer reads first that are not in HBM (for prefetch policies): in exact
    mode its first chunk, at most a quarter of HBM (the rest serves this read); in sparse
    mode its ``always_read`` blocks, which every sparse read of it uses."""
    if layer + 1 >= len(layers):
        return []
    nxt = layers[layer + 1]
    if mode is AttentionMode.EXACT:
        first = nxt.ids[: min(nxt.n, cache.window_blocks, max(1, cache.manager.dirs[0].capacity // 4))]
    else:
        first = nxt.ids[always_read(cache, nxt.n)]
    top = cache.manager.dirs[0].slot_of
    return [int(b) for b in first if int(b) not in top]
