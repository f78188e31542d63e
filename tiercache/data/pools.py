"""Preallocated block pools for the HBM and DRAM tiers.

A pool is one tensor ``[slots, *layout.block_shape]`` allocated once. The metadata plane
hands down slot numbers; the pool only copies bytes between slots and never decides
which slot is used. Nothing on the hot path allocates block-sized memory: copies go
straight between slots, ``read`` gathers into a caller-given ``out``.
"""

from __future__ import annotations

import ctypes
import os
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from ..config import KVLayout
from ..errors import UserError
from .buffers import aligned_tensor, check_blocks, check_capacity_blocks, check_out, normal_tensors, torch_dtype
from .pinning import registered_tensor

__all__ = ["BlockPool", "dram_pool", "hbm_pool", "copy_runs", "cuda_available", "HEADER_ROOM", "HEADER_BYTES"]

log = logging.getLogger(__name__)
_pin_fallback_logged = False
# Host-to-host copies: pieces of at most this size are dealt to the copy threads, and a
# batch under twice this size is copied inline (thread hand-off would cost more).
_HOST_PIECE = 4 << 20
_host_copier: ThreadPoolExecutor | None = None
_host_copier_lock = threading.Lock()


def _forget_copier_in_child() -> None:
    """``os.register_at_fork`` child handler: a forked child has none of the parent's copy
    threads (nor its lock's owner), so it starts its own pool."""
    global _host_copier, _host_copier_lock
    _host_copier, _host_copier_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_copier_in_child)

#: Host bytes a pool keeps before each slot when a remote tier is below it (one page, so
#: slots stay page aligned for O_DIRECT); the last ``HEADER_BYTES`` of it hold a remote
#: value's header, so the header and the block go over the wire as one buffer.
HEADER_ROOM = 4096
#: The remote value header's size (``remote`` takes it from here).
HEADER_BYTES = 64


def cuda_available() -> bool:
    """True when torch sees a CUDA device."""
    return torch.cuda.is_available()


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool):
    """Allocates the pool tensor; returns ``(tensor, owner, pinned)``.

    CPU memory comes from an anonymous mmap (page aligned, so O_DIRECT reads can land in a
    slot directly); pinned, that mmap is registered with CUDA (``pinning``: exactly the
    pool's bytes, where torch's pinned allocator would lock the next power of two). The
    tensor is a normal tensor even under ``torch.inference_mode()`` (``normal_tensors``): the
    pool's slots are written in place by every later call, in inference mode or not.
    """
    global _pin_fallback_logged
    if device.type != "cpu":
        with normal_tensors():
            return torch.zeros(shape, dtype=dtype, device=device), None, False
    if pin and cuda_available():
        return registered_tensor(shape, dtype)
    if pin and not _pin_fallback_logged:  # no CUDA: pinning is impossible, not an error
        log.info("pinned host memory unavailable (no CUDA device); DRAM pools use ordinary memory")
        _pin_fallback_logged = True
    tensor, owner = aligned_tensor(shape, dtype)
    return tensor, owner, False


def _as_slots(slots: Sequence[int] | np.ndarray | torch.Tensor, capacity: int, what: str) -> np.ndarray:
    """Slot numbers as an int64 array, each in ``[0, capacity)``.

    Raises:
        UserError: a slot out of range or not an integer.
    """
    if isinstance(slots, torch.Tensor):
        slots = slots.cpu().numpy()
    array = np.asarray(slots)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise UserError(f"{what}: expected a 1-D sequence of integer slots, got {array.dtype} of shape {array.shape}")
    array = array.astype(np.int64, copy=False)
    if array.size > 8:
        low, high = array.min(), array.max()
    elif array.size:  # a few slots (one at a time, often): Python's min and max beat two numpy passes
        values = array.tolist()
        low, high = min(values), max(values)
    else:
        return array
    if low < 0 or high >= capacity:
        raise UserError(f"{what}: slots must lie in [0, {capacity}), got min {low} max {high}")
    return array


def copy_runs(src_slots: np.ndarray, dst_slots: np.ndarray) -> list[tuple[int, int, int]]:
    """Coalesces a slot-to-slot copy into runs ``(src_start, dst_start, length)``.

    A run is a maximal stretch where both source and destination slots advance by one,
    so contiguous slots become one copy call instead of one per block.
    """
    if src_slots.size == 0:
        return []
    if src_slots.size == 1:  # one block (a policy that places one at a time): no numpy pass
        return [(int(src_slots[0]), int(dst_slots[0]), 1)]
    breaks = np.flatnonzero((np.diff(src_slots) != 1) | (np.diff(dst_slots) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src_slots.size]))
    return [(int(src_slots[s]), int(dst_slots[s]), int(e - s)) for s, e in zip(starts, ends)]


def _memmove_all(jobs: list[tuple[int, int, int]]) -> None:
    for dst, src, nbytes in jobs:
        ctypes.memmove(dst, src, nbytes)  # releases the GIL, so copy threads run in parallel


def _split(jobs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Cuts copies longer than ``_HOST_PIECE`` so threads share long runs too."""
    pieces = []
    for dst, src, nbytes in jobs:
        for offset in range(0, nbytes, _HOST_PIECE):
            pieces.append((dst + offset, src + offset, min(_HOST_PIECE, nbytes - offset)))
    return pieces


def _host_copy(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]], block_bytes: int) -> None:
    """Host to host copy of slot runs ``(src_start, dst_start, length)`` between CPU tensors
    of one dtype whose slots are contiguous (bounds checked by the caller); a run is one
    memmove where both sides' slots are adjacent, one per slot where a pool keeps header
    room between them.

    Plain memmove on as many threads as torch uses: per-block ``copy_`` calls pay torch's
    intra-op thread fork/join each, which costs a fifth of a 1 MiB copy and collapses when
    other processes share the cores.
    """
    global _host_copier
    base_dst, base_src = dst.data_ptr(), src.data_ptr()
    pitch_dst, pitch_src = _pitch(dst), _pitch(src)
    if pitch_dst != block_bytes or pitch_src != block_bytes:
        runs = [(s + i, d + i, 1) for s, d, n in runs for i in range(n)]
    jobs = _split([(base_dst + d * pitch_dst, base_src + s * pitch_src, n * block_bytes) for s, d, n in runs])
    workers = min(torch.get_num_threads(), len(jobs))
    if workers < 2 or sum(j[2] for j in jobs) < 2 * _HOST_PIECE:
        _memmove_all(jobs)
        return
    with _host_copier_lock:  # pools are used from several engine threads
        if _host_copier is None:
            _host_copier = ThreadPoolExecutor(torch.get_num_threads() - 1, "tiercache-copy")
    futures = [_host_copier.submit(_memmove_all, jobs[i::workers]) for i in range(1, workers)]
    _memmove_all(jobs[0::workers])
    for future in futures:
        future.result()


def _pitch(tensor: torch.Tensor) -> int:
    """Bytes from one slot of a ``[slots, ...]`` tensor to the next."""
    return tensor.stride(0) * tensor.element_size()


def _slots_contiguous(tensor: torch.Tensor) -> bool:
    """Whether each slot of a ``[slots, ...]`` tensor is contiguous and slots do not overlap
    (from its shape and strides: no view is made, this runs for every copy)."""
    shape, strides = tensor.shape, tensor.stride()
    if shape[0] == 0 or 0 in shape[1:]:  # no bytes in a slot: contiguous, as torch says it
        return True
    expected = 1
    for size, stride in zip(reversed(shape[1:]), reversed(strides[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return strides[0] >= expected


def _copy(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]], block_bytes: int, non_blocking: bool) -> None:
    """Copies slot runs from ``src`` to ``dst`` (both ``[slots, *block_shape]``, same dtype)."""
    if dst.device.type == src.device.type == "cpu" and _slots_contiguous(dst) and _slots_contiguous(src):
        _host_copy(dst, src, runs, block_bytes)
        return
    _copy_runs(dst, src, runs, non_blocking)


def _copy_runs(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]], non_blocking: bool) -> None:
    """``copy_`` of each run; slot by slot where a side's slots are not packed (a host pool
    with header room between them): a run of such slots is no contiguous span, and torch
    stages a non-contiguous host side through pageable memory, which makes a copy between
    pinned memory and the GPU synchronous; each slot alone is contiguous."""
    packed = all(t.shape[0] < 2 or t[:2].is_contiguous() for t in (dst, src))
    for src0, dst0, n in runs:
        if packed or n == 1:
            dst[dst0 : dst0 + n].copy_(src[src0 : src0 + n], non_blocking=non_blocking)
            continue
        for i in range(n):
            dst[dst0 + i].copy_(src[src0 + i], non_blocking=non_blocking)


class BlockPool:
    """A preallocated pool of KV blocks on one device.

    Invariants: ``tensor`` has shape ``[capacity, *layout.block_shape]`` and the layout's
    dtype, is allocated once in ``__init__`` and never reallocated, as a normal tensor even
    under ``torch.inference_mode()`` (so it is writable in and out of it); every slot argument is
    checked against ``[0, capacity)``. Copies to or from CUDA run on the current stream and
    are asynchronous when ``non_blocking`` is set: the caller records an event after them
    and waits on it before reusing the source or reading the destination.
    """

    def __init__(self, layout: KVLayout, capacity_blocks: int, device: str | torch.device = "cpu", pin_memory: bool = False,
                 header_room: int = 0):
        """Allocates the pool.

        Args:
            layout: block layout; the pool holds ``capacity_blocks`` blocks of it.
            capacity_blocks: number of slots, at least one.
            device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
            pin_memory: page-lock host memory (only meaningful on the CPU device); falls
                back to ordinary memory, logged once, when pinning is unavailable.
            header_room: host bytes kept free before each slot (``HEADER_ROOM`` under a
                remote tier: ``header`` gives a value header's place right before the
                block); ``tensor`` is then ``[slots, *block_shape]`` with a slot pitch of
                ``header_room + block_bytes`` (each slot contiguous).

        Raises:
            UserError: capacity below one block.
        """
        check_capacity_blocks(capacity_blocks, "BlockPool")
        self.layout = layout
        self.capacity = capacity_blocks
        self.dtype = torch_dtype(layout.dtype)
        device = torch.device(device)
        self.header_room = header_room if device.type == "cpu" else 0
        raw, self._owner, self.pinned = _allocate((capacity_blocks, self.header_room + layout.block_bytes), torch.uint8,
                                                  device, pin_memory)
        #: The pool's whole memory on its device, header room included (what a transfer engine
        #: registers for a host pool).
        self.host_buffer = raw
        with normal_tensors():  # views made in inference mode would carry its mark
            self.tensor = raw[:, self.header_room:].view(self.dtype).view(capacity_blocks, *layout.block_shape)
        self.device = self.tensor.device

    def header(self, slot: int) -> np.ndarray:
        """The ``HEADER_BYTES`` right before ``slot``'s block (a numpy view; needs header room)."""
        if self.header_room < HEADER_BYTES:
            raise UserError("BlockPool.header: this pool keeps no header room (header_room=0)")
        return self.host_buffer[slot, self.header_room - HEADER_BYTES : self.header_room].numpy()

    @property
    def block_bytes(self) -> int:
        """Bytes of one slot."""
        return self.layout.block_bytes

    def view(self, slot: int) -> torch.Tensor:
        """The block in ``slot`` as a view (no copy): shape ``layout.block_shape``."""
        if not 0 <= slot < self.capacity:
            raise UserError(f"BlockPool.view: slot must lie in [0, {self.capacity}), got {slot}")
        return self.tensor[slot]

    def write(self, slots: Sequence[int] | np.ndarray, blocks: torch.Tensor, non_blocking: bool = False) -> None:
        """Copies ``blocks[i]`` into slot ``slots[i]``.

        ``blocks`` may live on another device (pinned host to CUDA and back); each run of
        consecutive slots is one copy.

        Raises:
            UserError: wrong dtype or shape of ``blocks``, or a slot out of range.
        """
        dst = _as_slots(slots, self.capacity, "BlockPool.write slots")
        check_blocks(blocks, self.layout, dst.size, "BlockPool.write blocks")
        _copy(self.tensor, blocks, copy_runs(np.arange(dst.size), dst), self.block_bytes, non_blocking)

    def read(self, slots: Sequence[int] | np.ndarray, out: torch.Tensor | None = None, non_blocking: bool = False) -> torch.Tensor:
        """Gathers the blocks in ``slots`` into ``out`` (``[len(slots), *block_shape]``).

        Without ``out`` a new tensor is allocated on this pool's device: convenient, but
        the hot path passes a preallocated ``out`` (which may be on another device).

        Raises:
            UserError: wrong dtype or shape of ``out`` (or an inference tensor outside
                inference mode), or a slot out of range.
        """
        src = _as_slots(slots, self.capacity, "BlockPool.read slots")
        if out is None:
            out = torch.empty((src.size, *self.layout.block_shape), dtype=self.dtype, device=self.device)
        check_out(out, self.layout, src.size, "BlockPool.read out")
        _copy(out, self.tensor, copy_runs(src, np.arange(src.size)), self.block_bytes, non_blocking)
        return out

    def copy_to(self, dst: "BlockPool", src_slots: Sequence[int] | np.ndarray, dst_slots: Sequence[int] | np.ndarray, non_blocking: bool = True) -> None:
        """Copies blocks slot to slot from this pool into ``dst`` (e.g. DRAM to HBM).

        No staging: each run of consecutive slots on both sides is one copy (memmove on
        host threads between CPU pools; ``copy_`` otherwise). From a pinned pool to CUDA
        the copies are asynchronous on the current stream.

        Raises:
            UserError: layouts differ, lengths differ, or a slot out of range.
        """
        if dst.layout.block_shape != self.layout.block_shape or dst.dtype != self.dtype:
            raise UserError(f"BlockPool.copy_to: layouts differ: {self.layout.block_shape}/{self.layout.dtype} vs {dst.layout.block_shape}/{dst.layout.dtype}")
        src = _as_slots(src_slots, self.capacity, "BlockPool.copy_to src_slots")
        dst_array = _as_slots(dst_slots, dst.capacity, "BlockPool.copy_to dst_slots")
        if src.size != dst_array.size:
            raise UserError(f"BlockPool.copy_to: {src.size} source slots but {dst_array.size} destination slots")
        _copy(dst.tensor, self.tensor, copy_runs(src, dst_array), self.block_bytes, non_blocking)

    # -- the medium interface (``media.Medium``: what the engine and the store ask) -------
    #: A pool names nothing: the manager's directory says which block a slot holds.
    keyed = False

    def forget(self, keys: Sequence[bytes]) -> None:
        """Nothing to delete: a freed slot is simply reused."""

    def read_block(self, slot: int, key: bytes, dest: torch.Tensor) -> None:
        """Copies the block in ``slot`` into ``dest`` (any device)."""
        dest.copy_(self.view(slot))

    def durable_items(self) -> list[tuple[bytes, int]]:
        """Blocks that survive a restart: none (pools are volatile)."""
        return []

    def flush(self) -> None:
        """Nothing to make durable."""

    def close(self) -> None:
        """Nothing to release early: the tensor is freed with the pool."""

    def __repr__(self) -> str:
        return f"BlockPool({self.capacity} x {list(self.layout.block_shape)} {self.layout.dtype} on {self.device}, pinned={self.pinned})"


def dram_pool(layout: KVLayout, capacity_blocks: int, header_room: int = 0) -> BlockPool:
    """The DRAM tier: host memory, pinned when CUDA is available (else ordinary, logged once)."""
    return BlockPool(layout, capacity_blocks, "cpu", pin_memory=True, header_room=header_room)


def hbm_pool(layout: KVLayout, capacity_blocks: int, device: str | torch.device | None = None, header_room: int = 0) -> BlockPool:
    """The HBM tier: on ``device``, default the current CUDA device, or the CPU without CUDA."""
    if device is None:
        device = "cuda" if cuda_available() else "cpu"
    return BlockPool(layout, capacity_blocks, device, header_room=header_room)
