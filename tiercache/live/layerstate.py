"""A decoding sequence's state at one layer: its full blocks in order, their key summaries
and its partial tail block (``tiercache.live.sequence``)."""

from __future__ import annotations

import numpy as np
import torch

from tiercache.data.buffers import normal_tensors

__all__ = ["LayerState"]


class LayerState:
    """One layer of a sequence: its blocks in order, their summaries, its tail.

    Invariants: ``ids[:n]`` and ``keys`` name the full blocks in position order; rows
    ``[:n]`` of ``kmin``/``kmax`` are their summaries; ``tail_len < block_tokens``.
    ``kmin``, ``kmax`` and ``tail`` are normal tensors even when made under
    ``torch.inference_mode()`` (they are written in place by later calls, in it or not).
    """

    def __init__(self, kv_heads: int, block_tokens: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.n = 0
        self.ids = np.zeros(64, dtype=np.int64)
        self.keys: list[bytes] = []
        with normal_tensors():
            self.kmin = torch.empty((64, kv_heads, head_dim), dtype=torch.float32, device=device)
            self.kmax = torch.empty_like(self.kmin)
            self.tail = torch.empty((2, kv_heads, block_tokens, head_dim), dtype=dtype, device=device)
        self.tail_len = 0
        self.attends = 0

    def add(self, ids: list[int], keys: list[bytes], kmin: torch.Tensor, kmax: torch.Tensor) -> None:
        """Appends full blocks (ids, keys and summaries aligned). ``n`` is set last: an add
        that stops part-way (an error growing the arrays) adds nothing, and the next add
        overwrites whatever it wrote past ``n``."""
        need = self.n + len(ids)
        if need > len(self.ids):
            size = max(need, 2 * len(self.ids))
            self.ids = np.resize(self.ids, size)
            self.kmin = _grow(self.kmin, size)
            self.kmax = _grow(self.kmax, size)
        self.ids[self.n : need] = ids
        self.kmin[self.n : need] = kmin
        self.kmax[self.n : need] = kmax
        self.keys[self.n :] = keys
        self.n = need


    def copy(self) -> "LayerState":
        """An independent copy: the same blocks (ids, keys, summaries) and a copy of the tail,
        as normal tensors (in inference mode or not); the block ids are shared, not the arrays."""
        twin = LayerState.__new__(LayerState)
        twin.n, twin.ids, twin.keys = self.n, self.ids.copy(), list(self.keys)
        with normal_tensors():
            twin.kmin, twin.kmax, twin.tail = self.kmin.clone(), self.kmax.clone(), self.tail.clone()
        twin.tail_len, twin.attends = self.tail_len, self.attends
        return twin


def _grow(rows: torch.Tensor, size: int) -> torch.Tensor:
    """``rows`` copied into the first rows of a ``size``-row tensor (a normal tensor, as ``rows``)."""
    with normal_tensors():
        grown = torch.empty((size, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        grown[: rows.shape[0]] = rows
    return grown

