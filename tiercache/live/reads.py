"""Reading a live store's blocks from wherever they lie, into one tensor on the HBM device."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from tiercache.config import KVLayout
from tiercache.core.manager import TierManager
from tiercache.data.nvme_results import ReadIOError
from tiercache.data.pools import BlockPool

__all__ = ["read_blocks"]


def read_blocks(manager: TierManager, media: Sequence[object], layout: KVLayout, keys: Sequence[bytes], ids: list[int],
                out: torch.Tensor | None, partial: bool, drop_unreadable: Callable[[int, int], None]) -> torch.Tensor:
    """Blocks ``ids`` (named ``keys``) read from their tiers' media into ``out`` (a new
    tensor on the top medium's device when None), without moving them: one gather when all
    are in an HBM pool, else block by block, each where it lies.

    A block that proves unreadable (absent or corrupt) is handed to
    ``drop_unreadable(tier, block_id)`` (the manager never saw the read, so it must hear of
    the loss). A read that fails with an I/O error drops nothing: the block stays stored.
    Either ends the result with ``partial`` (the blocks before it are returned) or raises.

    Raises:
        ReadIOError: without ``partial``, a read failed with an I/O error (also a KeyError).
        KeyError: without ``partial``, a block unreadable or already dropped.
    """
    top = media[0]
    if out is None:
        out = torch.empty((len(ids), *layout.block_shape), dtype=top.dtype, device=top.device)
    slot_of = manager.dirs[0].slot_of
    if isinstance(top, BlockPool) and all(i in slot_of for i in ids):  # the common case: one gather from the HBM pool
        index = torch.tensor([slot_of[i] for i in ids], dtype=torch.long, device=top.device)
        return torch.index_select(top.tensor, 0, index, out=out)
    for index, block_id in enumerate(ids):
        tier = manager.locate(block_id)
        try:
            if tier is None:
                raise KeyError(f"key {keys[index].hex()} proved unreadable and was dropped")
            media[tier].read_block(manager.dirs[tier].slot_of[block_id], keys[index], out[index])
        except ReadIOError:  # this attempt failed; the block stays where it is
            if not partial:
                raise
            return out[:index]
        except KeyError:
            if tier is not None:
                drop_unreadable(tier, block_id)
            if not partial:
                raise
            return out[:index]
    return out
