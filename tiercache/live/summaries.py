"""Key summaries (per-channel min and max, Quest-style) of a decode cache's stored blocks, for
a sequence that starts from a stored prefix."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tiercache.attention import block_summaries
from tiercache.data.buffers import normal_tensors
from tiercache.data.nvme_results import ReadIOError

if TYPE_CHECKING:
    from .cache import TieredKVCache

__all__ = ["CorruptBlock", "keep_summaries", "read_where_stored", "summaries_of"]


class CorruptBlock(Exception):
    """A stored block proved corrupt while read (its medium dropped it)."""

    def __init__(self, tier: int, block_id: int) -> None:
        super().__init__(f"block {block_id} on tier {tier} is corrupt")
        self.tier, self.block_id = tier, block_id


def summaries_of(cache: "TieredKVCache", ids: list[int], keys: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """Key summaries of stored blocks: kept from the sequence that wrote them, or
    computed from the block read where it lies.

    Raises:
        CorruptBlock: a block's chunk proved corrupt (its medium dropped it; the caller
            reports it lost).
        ReadIOError: an I/O error (the block stays stored).
    """
    layout = cache.layout
    kmin = torch.empty((len(ids), layout.kv_heads, layout.head_dim), dtype=torch.float32, device=cache.device)
    kmax = torch.empty_like(kmin)
    scratch = None
    for row, (block_id, key) in enumerate(zip(ids, keys)):
        kept = cache._summaries.get(block_id)
        if kept is None:
            scratch = read_where_stored(cache, block_id, key, scratch)
            kept = block_summaries(scratch[:, 0].to(cache.device))
            kept = (kept[0][0], kept[1][0])
        kmin[row], kmax[row] = kept
    return kmin, kmax


def read_where_stored(cache: "TieredKVCache", block_id: int, key: bytes,
                      scratch: torch.Tensor | None = None) -> torch.Tensor:
    """One stored block's KV (``layout.block_shape``, the cache's dtype, on the CPU) read from
    the tier that holds it; a quantised tier's copy comes back decoded. Nothing moves.

    Args:
        scratch: a CPU tensor of the block's shape and dtype to read into, or None for a new one.

    Raises:
        CorruptBlock: the block's chunk proved corrupt (its medium dropped it; the caller
            reports it lost).
        ReadIOError: an I/O error (the block stays stored).
        KeyError: the block is not stored on any tier.
    """
    tier = cache.manager.locate(block_id)
    if tier is None:
        raise KeyError(block_id)
    if scratch is None:  # normal even in inference mode: a keyed medium's I/O thread writes it
        with normal_tensors():
            scratch = torch.empty(cache.layout.block_shape, dtype=cache.dtype)
    try:
        cache.store._media[tier].read_block(cache.manager.dirs[tier].slot_of[block_id], key, scratch)
    except ReadIOError:
        raise  # an I/O error says nothing of the stored bytes: the block stays
    except KeyError:  # a corrupt chunk: its medium dropped it
        raise CorruptBlock(tier, block_id) from None
    return scratch


def keep_summaries(cache: "TieredKVCache", state, start: int = 0) -> None:
    """Keeps the exact key summaries of a layer's stored blocks from row ``start`` on, for
    blocks a sequence lets go of (``free``, ``crop``): a later prompt reusing one then needs
    no summary rebuilt from a lossy tier's copy. A block's summaries are kept once (a stored
    block's KV never changes)."""
    with normal_tensors():  # kept past this call: normal tensors, in inference mode or not
        for row in range(start, state.n):
            block_id = int(state.ids[row])
            if block_id not in cache._summaries:
                cache._summaries[block_id] = (state.kmin[row].clone(), state.kmax[row].clone())
