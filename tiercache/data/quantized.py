"""A quantised memory tier (DRAM, or HBM): ``QuantizedPool`` and its copy handlers.

A ``QuantizedPool`` holds each block as the bytes of a block codec (``codecs.py``: INT8,
FP8 or INT4, scales included), one uint8 row of ``Codec.block_bytes(layout)`` per slot, so
the tier holds 2-4x the blocks of a plain pool in the same memory. Blocks are quantised
when they are demoted into it and dequantised when they are promoted out of it or read
(a decode step's attention dequantises a quantised tier's blocks chunk by chunk):

* pool -> quantised pool: encoded from the source slot (on the GPU for a GPU pool, then
  only the encoded bytes cross to the host);
* quantised pool -> pool: decoded into the destination slot (a GPU destination gets the
  encoded bytes and dequantises on the GPU);
* quantised pool <-> quantised pool (a quantised HBM over a quantised DRAM): the encoded
  bytes as they are with the same codec, else decoded and re-encoded;
* quantised pool <-> NVMe: with the NVMe tier's codec the same, the encoded bytes are
  written and read as they are (``submit_put_encoded``/``submit_get_encoded``: a block is
  never quantised twice); otherwise through a plain block, which the store encodes with
  its own codec.

A block the destination's codec refuses (``codec_base.UnencodableError``: inf, NaN, or INT8
and INT4 values beyond their fp16 scales; only blocks adopted from a plain store can hold
them, since ``put`` refuses such KV in a hierarchy with a quantised tier) is reported lost
(``JobResult.lost``): the manager drops it, counted, as it drops an unreadable chunk. Kept
where it was, every later move would fail the same way and it would hold its slot for good.

Importing this module registers the handlers (``handlers.register_handler``); the live
store imports it when it opens a quantised DRAM tier, before its engine looks handlers up.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import numpy as np
import torch

from tiercache.core.plans import JobResult, TransferPlan

from ..config import Codec, KVLayout
from ..errors import UserError
from .buffers import check_capacity_blocks, normal_tensors, torch_dtype
from .codec_base import UnencodableError
from .codecs import codec_for
from .handlers import CopyContext, Job, _read_result, _recycling, _write_result, register_handler
from .nvme import NVMeStore
from .pools import BlockPool, _allocate, _as_slots, cuda_available

__all__ = ["QuantizedPool"]


class QuantizedPool:
    """Preallocated host slots of encoded blocks (the ``Medium`` protocol, unkeyed).

    Invariants: ``encoded`` is ``[capacity, block_bytes]`` uint8 with ``block_bytes ==
    codec.block_bytes(layout)``, a normal tensor even when the pool is built under
    ``torch.inference_mode()`` (``pools._allocate``); a slot holds the ``BlockCodec.encode_into`` bytes of one
    ``layout`` block; the pool never decides which slot holds what (plans do).
    """

    keyed = False

    def __init__(self, layout: KVLayout, capacity_blocks: int, codec: Codec, pin_memory: bool | None = None,
                 device: str | torch.device = "cpu") -> None:
        """Allocates ``capacity_blocks`` encoded slots on ``device`` (host slots pinned when
        CUDA is available).

        Raises:
            UserError: ``codec`` is ``Codec.NONE`` (use a ``BlockPool``) or not a Codec, or the
                capacity is below one block.
        """
        if not isinstance(codec, Codec) or codec is Codec.NONE:
            raise UserError(f"QuantizedPool: codec must be int8, fp8 or int4, got {codec!r} (a plain tier is a BlockPool)")
        check_capacity_blocks(capacity_blocks, "QuantizedPool")
        self.layout, self.codec, self.capacity = layout, codec, capacity_blocks
        self.block_bytes = codec.block_bytes(layout)
        self.device = torch.device(device)
        self._impl = codec_for(codec)
        self.dtype = self._dtype = torch_dtype(layout.dtype)  # of the blocks it encodes and decodes
        pin = cuda_available() if pin_memory is None else pin_memory
        self.encoded, self._owner, self.pinned = _allocate((capacity_blocks, self.block_bytes), torch.uint8, self.device, pin)
        self.device = self.encoded.device  # with its index, as a tensor on it reports it (cuda:0, not cuda)

    def view(self, slot: int) -> torch.Tensor:
        """The encoded bytes of ``slot`` (a view)."""
        return self.encoded[slot]

    def encode_into(self, slot: int, block: torch.Tensor) -> None:
        """Quantises ``block`` (any device) into ``slot``."""
        self._impl.encode_into(block, self.encoded[slot])

    def decode_into(self, slot: int, dest: torch.Tensor) -> None:
        """Dequantises ``slot`` into ``dest``; where ``dest`` is on another device only the
        encoded bytes are copied over and ``dest``'s device dequantises them."""
        src = self.encoded[slot]
        if dest.device != src.device:
            # Synchronous: the job settles at once, so the slot may be rewritten right after;
            # an asynchronous copy could still be reading it then.
            src = src.to(dest.device)
        self._impl.decode_from(src, self._dtype, dest)

    def copy_slot(self, slot: int, dst: "QuantizedPool", dst_slot: int) -> None:
        """Moves the block of ``slot`` into ``dst``'s ``dst_slot``: the encoded bytes as
        they are with the same codec, else decoded and re-encoded with ``dst``'s."""
        if dst.codec is self.codec:
            dst.encoded[dst_slot].copy_(self.encoded[slot])
            return
        block = torch.empty(self.layout.block_shape, dtype=self._dtype, device=self.device)
        self.decode_into(slot, block)
        dst.encode_into(dst_slot, block)

    @property
    def tensor(self) -> torch.Tensor:
        """Refused: a plain pool's ``tensor`` is its blocks as they are, which code that reads
        a memory tier in place (the decode loop, ``TieredKVCache``) relies on; this pool's
        bytes are encoded (see ``encoded``), so such code must not treat them as blocks.

        Raises:
            UserError: always, naming what to do instead.
        """
        raise UserError(f"this memory tier is quantised ({self.codec.value}): its blocks cannot be read in place as "
                        "plain KV; read them through TieredKVStore.get (or decode_into), or use a plain tier")

    # ----- the medium interface ---------------------------------------------------------

    def write(self, slots: Sequence[int], blocks: torch.Tensor) -> None:
        """Quantises new blocks into ``slots``."""
        slots = _as_slots(slots, self.capacity, "QuantizedPool.write")
        for slot, block in zip(slots.tolist(), blocks.unbind(0), strict=True):
            self.encode_into(slot, block)

    def forget(self, keys: Sequence[bytes]) -> None:
        """Nothing to drop: a slot is reused by the next plan that names it."""

    def read_block(self, slot: int, key: bytes, dest: torch.Tensor) -> None:
        """Dequantises the block of ``slot`` into ``dest``."""
        self.decode_into(int(slot), dest)

    def durable_items(self) -> list[tuple[bytes, int]]:
        """Nothing survives a restart in DRAM."""
        return []

    def flush(self) -> None:
        """Volatile: nothing to make durable."""

    def close(self) -> None:
        """Releases nothing early: the memory goes with the pool."""

    def __repr__(self) -> str:
        return f"QuantizedPool({self.codec.value}, {self.capacity} blocks of {self.block_bytes} B)"


def _ints(slots) -> list[int]:
    """A plan's slots as Python ints."""
    return [int(s) for s in slots]


def _refused(ids: Sequence[int], encodes: Sequence[Callable[[], None]]) -> list[int]:
    """Runs ``encodes`` (one per id of ``ids``, each quantising that block into its slot) and
    returns the ids whose block the codec refused (``UnencodableError``); the others ran."""
    refused = []
    for block_id, encode in zip(ids, encodes, strict=True):
        try:
            encode()
        except UnencodableError:
            refused.append(block_id)
    return refused


def _lost_result(plan: TransferPlan, codec: Codec, refused: Sequence[int], unreadable: Sequence[int] = ()) -> JobResult:
    """The result of a job into a ``codec`` tier: done, or failed with its ``unreadable``
    (corrupt or missing chunks) and ``refused`` blocks (values the codec cannot store) lost,
    which the manager drops (``JobResult.lost``); the job's other blocks stay where they were."""
    if not refused and not unreadable:
        return JobResult(plan.job_id)
    why = [f"{len(unreadable)} block(s) unreadable (corrupt or missing)"] if unreadable else []
    if refused:
        why.append(f"{len(refused)} block(s) the {codec.value} tier cannot encode (inf, NaN or values beyond its scales)")
    return JobResult(plan.job_id, "; ".join(why) + ": dropped as lost", (*unreadable, *refused))


class QuantizedToQuantized:
    """Quantised HBM <-> quantised DRAM: ``QuantizedPool.copy_slot`` per block (inline);
    a block the destination's codec refuses (re-encoded from another codec's values) is lost."""

    def start(self, plan: TransferPlan, src: QuantizedPool, dst: QuantizedPool, ctx: CopyContext) -> Job:
        pairs = zip(_ints(plan.src_slots), _ints(plan.dst_slots), strict=True)
        refused = _refused(plan.ids, [functools.partial(src.copy_slot, s, dst, d) for s, d in pairs])
        return Job(plan, result=_lost_result(plan, dst.codec, refused))


class PoolToQuantized:
    """HBM or DRAM -> quantised DRAM: each block encoded from its source slot (inline); a
    block the codec refuses is lost (the module docstring)."""

    def start(self, plan: TransferPlan, src: BlockPool, dst: QuantizedPool, ctx: CopyContext) -> Job:
        # On a GPU the encode runs on the current (compute) stream, after every write queued
        # there into the source slots; blocks copied in on a copy stream are published only
        # once their event completed, so no stream wait is needed here.
        pairs = zip(_ints(plan.src_slots), _ints(plan.dst_slots), strict=True)
        refused = _refused(plan.ids, [functools.partial(dst.encode_into, d, src.view(s)) for s, d in pairs])
        return Job(plan, result=_lost_result(plan, dst.codec, refused))


class QuantizedToPool:
    """Quantised DRAM -> HBM or DRAM: each block decoded into its destination slot (inline)."""

    def start(self, plan: TransferPlan, src: QuantizedPool, dst: BlockPool, ctx: CopyContext) -> Job:
        for src_slot, dst_slot in zip(_ints(plan.src_slots), _ints(plan.dst_slots), strict=True):
            src.decode_into(src_slot, dst.view(dst_slot))
        return Job(plan, result=JobResult(plan.job_id))


class QuantizedToStore:
    """Quantised DRAM -> NVMe: the encoded rows as they are (same codec), else decoded
    blocks that the store encodes with its own codec; I/O threads write them."""

    def start(self, plan: TransferPlan, src: QuantizedPool, store: NVMeStore, ctx: CopyContext) -> Job:
        keys = ctx.keys(plan.ids)
        slots = _ints(plan.src_slots)
        if store.codec is src.codec:  # a GPU pool's rows are copied to the host first
            future = _recycling(store.submit_put_encoded, store, keys, [src.view(s).cpu() for s in slots])
        else:
            with normal_tensors():  # the I/O threads (never in inference mode) read it
                blocks = torch.empty((len(slots), *src.layout.block_shape), dtype=src._dtype)
            for index, slot in enumerate(slots):
                src.decode_into(slot, blocks[index])
            future = _recycling(store.submit_put, store, keys, blocks)
        return Job(plan, future=future, finish=lambda outcome: _write_result(plan, store, outcome))


class StoreToQuantized:
    """NVMe -> quantised DRAM: the stored bytes straight into the rows (same codec), else
    dequantised blocks encoded into the rows once read; unreadable blocks are lost, and so
    are blocks the codec refuses (read from a plain store)."""

    def start(self, plan: TransferPlan, store: NVMeStore, dst: QuantizedPool, ctx: CopyContext) -> Job:
        keys = ctx.keys(plan.ids)
        slots = _ints(plan.dst_slots)
        if store.codec is dst.codec and dst.device.type == "cpu":
            future = store.submit_get_encoded(keys, [dst.view(s) for s in slots])
            return Job(plan, future=future, finish=lambda hits: _read_result(plan, hits))
        if store.codec is dst.codec:  # a GPU pool: read into host rows, then copy them over
            with normal_tensors():  # written by the I/O threads, which never run in inference mode
                rows = torch.empty((len(slots), dst.block_bytes), dtype=torch.uint8)
            future = store.submit_get_encoded(keys, list(rows.unbind(0)))

            def finish_rows(hits: np.ndarray) -> JobResult:
                for index in np.flatnonzero(hits).tolist():
                    dst.encoded[slots[index]].copy_(rows[index])
                return _read_result(plan, hits)

            return Job(plan, future=future, finish=finish_rows)
        with normal_tensors():  # written by the I/O threads, which never run in inference mode
            blocks = torch.empty((len(slots), *dst.layout.block_shape), dtype=dst._dtype)
        future = store.submit_get(keys, blocks)

        def finish(hits: np.ndarray) -> JobResult:
            read = np.flatnonzero(hits).tolist()
            encodes = [functools.partial(dst.encode_into, slots[i], blocks[i]) for i in read]
            refused = _refused([plan.ids[i] for i in read], encodes)
            return _lost_result(plan, dst.codec, refused, [b for b, ok in zip(plan.ids, hits.tolist()) if not ok])

        return Job(plan, future=future, finish=finish)


register_handler(BlockPool, QuantizedPool, PoolToQuantized())
register_handler(QuantizedPool, QuantizedPool, QuantizedToQuantized())
register_handler(QuantizedPool, BlockPool, QuantizedToPool())
register_handler(QuantizedPool, NVMeStore, QuantizedToStore())
register_handler(NVMeStore, QuantizedPool, StoreToQuantized())
