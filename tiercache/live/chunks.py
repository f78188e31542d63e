"""Where a streamed read's chunks come from: blocks grouped by the tier holding them.

``TierChunks`` is the ``ChunkSource`` (``tiercache.attention``) of a decode cache's read:
NVMe chunks are read by the store's I/O threads into the cache's host window; memory-tier
chunks are read where they lie (a quantised memory tier's blocks are dequantised one by one
into the chunk's device buffer). ``split_kv`` turns stored blocks into the K and V that
attention computes on.
"""

from __future__ import annotations

from concurrent import futures
from typing import TYPE_CHECKING

import numpy as np
import torch

from tiercache.attention import compute_dtype
from tiercache.core.interrupts import interruptible_wait
from tiercache.data.nvme_results import ReadIOError
from tiercache.data.pools import BlockPool
from tiercache.data.quantized import QuantizedPool

if TYPE_CHECKING:
    from .cache import TieredKVCache

__all__ = ["TierChunks", "split_kv"]


class TierChunks:
    """The ``ChunkSource`` of a read: blocks grouped by the tier holding them, in chunks.

    Chunks on a keyed medium (NVMe) come first, so their reads start before any compute;
    each is read by the store's I/O threads into a window buffer. Chunks in memory tiers
    are read where they lie (a contiguous run of slots is a view, otherwise one gather).
    The read's references (``StepDriver.begin_read``) keep every block where it was found.
    """

    def __init__(self, cache: TieredKVCache, ids: list[int], keys: list[bytes]) -> None:
        self.cache = cache
        manager = cache.manager
        groups: dict[int, list[int]] = {}
        for position, block_id in enumerate(ids):
            tier = manager.locate(block_id)
            if tier is None:
                raise RuntimeError(f"block {block_id} of this sequence is no longer stored (lost: unreadable)")
            groups.setdefault(tier, []).append(position)
        media = cache.store._media
        order = sorted(groups, key=lambda t: (not media[t].keyed, -t))
        width = cache.window_blocks
        self.chunks: list[tuple[int, list[int], list[bytes]]] = []
        for tier in order:
            positions = groups[tier]
            for a in range(0, len(positions), width):
                part = positions[a : a + width]
                self.chunks.append((tier, [ids[p] for p in part], [keys[p] for p in part]))
        self.n_chunks = len(self.chunks)

    def start(self, index: int, buffer: int):
        tier, ids, keys = self.chunks[index]
        medium = self.cache.store._media[tier]
        if not medium.keyed:
            return (index, buffer, None)
        width = self.cache.window_blocks
        window = self.cache._window_pool().tensor[buffer * width : buffer * width + len(ids)]
        return (index, buffer, (medium.submit_get(keys, window), window))

    def settle(self, handle) -> None:
        """Waits for a started chunk's read to land, taking nothing from it (a read abandoned
        by a failed step must not write its window buffer under the next one)."""
        pending = handle[2]
        if pending is not None:
            with interruptible_wait():  # a hung disk must not make the call deaf to Ctrl-C
                futures.wait([pending[0]])

    def finish(self, handle) -> tuple[torch.Tensor, torch.Tensor]:
        _, k, v = self.cache._scratch(handle[1])
        index, _, pending = handle
        medium = self.cache.store._media[self.chunks[index][0]]
        if pending is None and isinstance(medium, BlockPool) and medium.tensor.device == k.device:
            return self._convert_in_place(index, k, v)
        return split_kv(self.raw(handle), k, v)

    def _convert_in_place(self, index: int, k_out: torch.Tensor, v_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a memory-tier chunk converted straight from the pool into the
        scratch (one pass: no gather copy first), one copy per run of adjacent slots."""
        tier, ids, _ = self.chunks[index]
        cache = self.cache
        pool = cache.store._media[tier].tensor
        slot_of = cache.manager.dirs[tier].slot_of
        layout = cache.layout
        n, tokens = len(ids), layout.block_tokens
        k = k_out[:, : n * tokens].view(layout.kv_heads, n, tokens, layout.head_dim)
        v = v_out[:, : n * tokens].view(layout.kv_heads, n, tokens, layout.head_dim)
        slots = [slot_of[b] for b in ids]
        start = 0
        for end in range(1, n + 1):
            if end == n or slots[end] != slots[end - 1] + 1:
                src = pool[slots[start] : slots[start] + end - start]
                for head in range(layout.kv_heads):  # [blocks, T, D] per head: contiguous rows
                    k[head, start:end].copy_(src[:, 0, 0, head])
                    v[head, start:end].copy_(src[:, 0, 1, head])
                start = end
        return k.view(layout.kv_heads, n * tokens, layout.head_dim), v.view(layout.kv_heads, n * tokens, layout.head_dim)

    def raw(self, handle) -> torch.Tensor:
        """Waits for a chunk and returns its blocks as stored, ``[n, 1, 2, kv, T, D]``."""
        index, buffer, pending = handle
        tier, ids, _ = self.chunks[index]
        cache = self.cache
        if pending is None:
            slots = [cache.manager.dirs[tier].slot_of[b] for b in ids]
            medium = cache.store._media[tier]
            if isinstance(medium, QuantizedPool):  # dequantised block by block, on the compute device
                blocks = cache._scratch(buffer)[0][: len(slots)]
                for row, slot in enumerate(slots):
                    medium.decode_into(slot, blocks[row])
                return blocks
            pool = medium.tensor
            if pool.device == cache.device:
                return _gather(pool, slots, cache._scratch(buffer)[0])
            width = cache.window_blocks  # a host tier under a GPU: gather on the host, then copy
            blocks = _gather(pool, slots, cache._window_pool().tensor[buffer * width : (buffer + 1) * width])
        else:
            future, window = pending
            try:
                with interruptible_wait():  # a hung disk must not make the call deaf to Ctrl-C
                    good = future.result()
            except ReadIOError as error:  # the batch's corrupt chunks are gone all the same: say so
                lost = [b for b, key in zip(ids, self.chunks[index][2]) if key in error.lost_keys]
                if lost:
                    cache.manager.report_lost(tier, lost)
                    cache._settle_events()
                raise
            if not bool(np.all(good)):
                lost = [b for b, ok in zip(ids, good) if not ok]
                cache.manager.report_lost(tier, lost)
                cache._settle_events()
                raise RuntimeError(f"{len(lost)} KV block(s) of this sequence proved unreadable on {cache.manager.dirs[tier].name} "
                                   "(corrupt or missing chunk): dropped and counted; attention over the rest would be wrong")
            blocks = window
        # Synchronous on purpose: the host window buffer is refilled by the next fetch into
        # it, which must not overwrite bytes an asynchronous copy has not read yet.
        return blocks.to(cache.device)


def _gather(tensor: torch.Tensor, slots: list[int], out: torch.Tensor) -> torch.Tensor:
    """Blocks at ``slots`` of a pool tensor: a view for a contiguous ascending run, else one
    row gather over the flat blocks (a memcpy per block) into ``out``'s first rows."""
    first = slots[0]
    if slots[-1] - first == len(slots) - 1 and slots == list(range(first, first + len(slots))):
        return tensor[first : first + len(slots)]
    index = torch.tensor(slots, dtype=torch.long, device=tensor.device)
    rows = out[: len(slots)]
    torch.index_select(tensor.view(tensor.shape[0], -1), 0, index, out=rows.view(len(slots), -1))
    return rows


def split_kv(blocks: torch.Tensor, k_out: torch.Tensor | None = None,
              v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, 1, 2, kv, T, D]`` blocks -> K and V as ``[kv, n*T, D]`` in the compute dtype
    (one copy that converts and reorders at once), into the leading part of ``k_out`` and
    ``v_out`` (``[kv, >= n*T, D]``) when given."""
    n, _, _, kv_heads, tokens, head_dim = blocks.shape
    dtype = compute_dtype(blocks.dtype)
    if k_out is None:
        k_out = torch.empty((kv_heads, n * tokens, head_dim), dtype=dtype, device=blocks.device)
        v_out = torch.empty_like(k_out)
    k = k_out[:, : n * tokens].view(kv_heads, n, tokens, head_dim)
    v = v_out[:, : n * tokens].view(kv_heads, n, tokens, head_dim)
    for head in range(kv_heads):  # per head: rows of T*D contiguous elements (a 4-D permuted copy is slow)
        k[head].copy_(blocks[:, 0, 0, head])
        v[head].copy_(blocks[:, 0, 1, head])
    return k.view(kv_heads, n * tokens, head_dim), v.view(kv_heads, n * tokens, head_dim)
