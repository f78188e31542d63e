"""Reading a live store's blocks from wherever they lie, into one tensor on the HBM device."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from tiercache.config import KVLayout
from tiercache.core.manager import TierManager
from tiercache.data.buffers import normal_tensors
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
    the loss). A read that fails with an I/O error, or that the remote store did not answer
    (``ReadIOError`` both), drops nothing: the block stays stored.
    Either ends the result with ``partial`` (the blocks before it are returned) or raises.

    A new ``out`` is a normal tensor, even under ``torch.inference_mode()``: a keyed medium's
    I/O threads (which never run in inference mode) write into it. An ``out`` that is an
    inference tensor (the caller's, made under ``torch.inference_mode()`` and used in it) gets
    such blocks through a normal staging block, copied in on the caller's thread.

    Raises:
        ReadIOError: without ``partial``, a read failed with an I/O error (also a KeyError).
        KeyError: without ``partial``, a block unreadable or already dropped.
    """
    top = media[0]
    if out is None:
        with normal_tensors():
            out = torch.empty((len(ids), *layout.block_shape), dtype=top.dtype, device=top.device)
    slot_of = manager.dirs[0].slot_of
    if isinstance(top, BlockPool) and all(i in slot_of for i in ids):  # the common case: one gather from the HBM pool
        index = torch.tensor([slot_of[i] for i in ids], dtype=torch.long, device=top.device)
        return torch.index_select(top.tensor, 0, index, out=out)
    staging: list[torch.Tensor] = []  # a normal host block, made if ``_read_one`` needs it
    for index, block_id in enumerate(ids):
        tier = manager.locate(block_id)
        try:
            if tier is None:
                raise KeyError(f"key {keys[index].hex()} proved unreadable and was dropped")
            _read_one(media[tier], manager.dirs[tier].slot_of[block_id], keys[index], out[index], staging)
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


def _read_one(medium, slot: int, key: bytes, dest: torch.Tensor, staging: list[torch.Tensor]) -> None:
    """``medium.read_block`` into ``dest``. A keyed medium's I/O threads never run in inference
    mode, so they must write a normal tensor: a read into an inference ``dest`` (the caller's
    ``out``) lands in ``staging[0]`` (a normal host block, made at first need) and is copied
    over here, on the caller's thread. (A device ``dest`` is staged by the medium itself,
    through a normal host tensor: ``nvme_read.NVMeReads.read_block``.)"""
    if not (medium.keyed and dest.is_inference()):
        medium.read_block(slot, key, dest)
        return
    if not staging:
        with normal_tensors():
            staging.append(torch.empty(dest.shape, dtype=dest.dtype))
    medium.read_block(slot, key, staging[0])
    dest.copy_(staging[0])
