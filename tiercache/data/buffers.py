"""Host buffers shared by the pools and the NVMe store: dtypes, aligned memory, byte views.

Everything here is data plane (imports torch). Buffers are allocated once, off the hot path;
the hot path only takes views of them.
"""

from __future__ import annotations

import math

import ctypes
import mmap
from typing import Sequence

import numpy as np
import torch

from ..config import KVLayout
from ..errors import UserError

__all__ = [
    "PAGE",
    "torch_dtype",
    "round_up",
    "aligned_tensor",
    "byte_array",
    "HostBytes",
    "is_aligned",
    "check_blocks",
    "check_out",
    "overlaps_itself",
    "memory_span",
    "shares_memory",
    "block_list",
    "normal_tensors",
]

# Alignment that satisfies O_DIRECT on every Linux filesystem we target (logical block
# sizes are 512 or 4096 bytes) and is the page size on x86-64 and most arm64 kernels.
PAGE = 4096

_TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a layout dtype name such as ``"bfloat16"``.

    Raises:
        UserError: the name is not a known KV dtype.
    """
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}; known: {', '.join(_TORCH_DTYPES)}") from None


def normal_tensors() -> torch.inference_mode:
    """A context manager (or decorator) under which new tensors are normal tensors, even
    inside a caller's ``torch.inference_mode()``.

    Every tensor a store, cache, sequence or pool keeps and later updates in place (pool
    slots, window and scratch buffers, a sequence's tail and summaries, I/O threads'
    staging) is allocated under it: an inference tensor could not be updated outside
    inference mode (nor by an I/O thread, which never runs in it), so a store first used
    under ``torch.inference_mode()`` would break every later call outside it. Writing into
    a normal tensor inside inference mode is allowed, so the hot path needs no context of
    its own; only allocation sites use this (about 2 us each).
    """
    return torch.inference_mode(False)


def round_up(n: int, align: int = PAGE) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return (n + align - 1) // align * align


def aligned_tensor(shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """A zeroed, page-aligned CPU tensor backed by an anonymous mmap.

    Page alignment lets O_DIRECT read straight into the tensor. The pages are touched here
    (``zero_``) so that the first use on the hot path does not pay page faults. The tensor
    is a normal tensor even under ``torch.inference_mode()`` (``normal_tensors``).

    Returns:
        The tensor and the mmap that owns its memory; keep the mmap alive with the tensor.
    """
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(round_up(nbytes), PAGE))
    with normal_tensors():
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
        tensor = flat.view(dtype).view(*shape)
        tensor.view(torch.uint8).zero_()
    return tensor, buf


def byte_array(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view (no copy) of a contiguous CPU tensor's memory.

    numpy arrays are used rather than memoryviews because they are accepted both by
    ``os.preadv``/``os.writev`` and by the crc32c extension.
    """
    return tensor.reshape(-1).view(torch.uint8).numpy()


class HostBytes:
    """Fast uint8 numpy views of contiguous host tensors of one fixed byte size.

    Built from the tensor's address (a fraction of ``byte_array``'s cost, which matters
    once per block on the I/O path). The view does not keep the tensor alive: callers
    hold the tensor for as long as they use the view.
    """

    def __init__(self, nbytes: int) -> None:
        self._ctype = ctypes.c_ubyte * nbytes

    def __call__(self, tensor: torch.Tensor) -> np.ndarray | None:
        """The view, or None when the tensor is not contiguous host memory."""
        if not (tensor.is_cpu and tensor.is_contiguous()):
            return None
        return np.frombuffer(self._ctype.from_address(tensor.data_ptr()), dtype=np.uint8)


def is_aligned(tensor: torch.Tensor, align: int = PAGE) -> bool:
    """True when the tensor's first byte sits on an ``align`` boundary."""
    return tensor.data_ptr() % align == 0


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_blocks(blocks: torch.Tensor, layout: KVLayout, count: int, what: str, limit: float | None = None) -> None:
    """Validates a batch tensor ``[count, *layout.block_shape]`` of the layout's dtype (and,
    with a ``limit``, finite with every ``|x| <= limit``: what a quantised tier needs).

    Raises:
        UserError: not a tensor, wrong dtype, or wrong shape; the message gives expected
            and actual values; or a value a quantised tier cannot hold, naming the first
            block holding one.
    """
    if not isinstance(blocks, torch.Tensor):
        raise UserError(f"{what}: expected a torch.Tensor, got {type(blocks).__name__}")
    if blocks.device.type == "meta":
        raise UserError(f"{what}: a tensor on the meta device holds no data")
    if blocks.layout != torch.strided:
        raise UserError(f"{what}: expected a dense tensor, got layout {str(blocks.layout).replace('torch.', '')} "
                        "(call .to_dense() first)")
    expected_dtype = torch_dtype(layout.dtype)
    if blocks.dtype != expected_dtype:
        raise UserError(f"{what}: expected dtype {layout.dtype}, got {str(blocks.dtype).replace('torch.', '')}")
    expected = (count, *layout.block_shape)
    if tuple(blocks.shape) != expected:
        raise UserError(f"{what}: expected shape {_shape_text(expected)}, got {_shape_text(blocks.shape)}")
    if limit is not None:
        check_quantisable(blocks, what, limit)


def check_out(out: torch.Tensor, layout: KVLayout, count: int, what: str,
              pools: Sequence[tuple[str, torch.Tensor]] = ()) -> None:
    """``check_blocks`` for a caller's tensor a call writes into (an ``out=``): also refuses
    an inference tensor outside inference mode, which torch forbids writing (its I/O threads
    would fail part-way otherwise), an ``out`` whose elements share memory (``overlaps_itself``:
    a block written into it would land on another's bytes), and one whose memory meets one
    of ``pools`` (``(name, tensor)``, the name as the message says it, e.g. "the store's hbm
    pool": the memory of the tiers a read copies from, whose slots hold other stored blocks).
    The caller checks before it reads or writes anything.

    Raises:
        UserError: as ``check_blocks``; ``out`` is an inference tensor and the caller is not
            in ``torch.inference_mode()``; its elements (may) share memory; or it lies in the memory
            of a pool (naming it). The message names ``what``.
    """
    check_blocks(out, layout, count, what)
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise UserError(f"{what}: an inference tensor (made under torch.inference_mode()) cannot be written outside "
                        "inference mode; pass a normal tensor, or call under torch.inference_mode()")
    if overlaps_itself(out):
        raise UserError(f"{what}: its elements share (or may share) memory: strides {list(out.stride())} for shape "
                        f"{_shape_text(out.shape)} (a stride 0 where the size is above 1, as expand() makes, or strides "
                        "that do not nest), so blocks written into it could overwrite each other; pass a tensor whose "
                        "elements each have their own memory (torch.empty)")
    for name, pool in pools:
        if shares_memory(out, pool):
            raise UserError(f"{what}: it lies in the memory of {name}, whose slots hold stored blocks (writing the "
                            "result there would overwrite them); pass a buffer of its own")


def overlaps_itself(tensor: torch.Tensor) -> bool:
    """True when two elements of ``tensor`` may sit at one address: a dimension longer than
    one with stride 0 (``expand``), or strides that do not nest (each dimension's stride, in
    increasing order, must exceed the reach of those below it). Every view a slice, a
    transpose or a reshape makes of a dense tensor nests, so none of them is refused; only
    a hand-made ``as_strided`` interleaving may be refused although it does not overlap."""
    reach = 0  # elements spanned by the dimensions seen so far, minus one
    for stride, size in sorted((st, sz) for st, sz in zip(tensor.stride(), tensor.shape) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def memory_span(tensor: torch.Tensor) -> tuple[int, int]:
    """``[start, end)`` byte addresses of the memory ``tensor``'s elements lie in (its first to
    just past its last element; strides are never negative in torch); ``(0, 0)`` when empty."""
    if tensor.numel() == 0:
        return 0, 0
    last = sum(stride * (size - 1) for stride, size in zip(tensor.stride(), tensor.shape))
    start = tensor.data_ptr()
    return start, start + (last + 1) * tensor.element_size()


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` are on one device and their ``memory_span``s meet (an ``a``
    inside the gaps of a strided ``b`` counts: it lies within ``b``'s memory all the same)."""
    if a.device != b.device:
        return False
    (a0, a1), (b0, b1) = memory_span(a), memory_span(b)
    return a0 < b1 and b0 < a1


def check_quantisable(blocks: torch.Tensor, what: str, limit: float, unit: str = "block", dim: int = 0) -> None:
    """Raises UserError naming the first ``unit`` (index along ``dim``: a block of a batch, a
    token of a sequence's KV) holding inf, NaN or a value beyond ``limit`` (the codecs' fp16
    scales: ``live.media.value_limit``): a quantised tier cannot store it (one inf would
    turn its whole group into NaN)."""
    if not blocks.numel():
        return
    bad = ~torch.isfinite(blocks)
    if math.isfinite(limit) and blocks.dtype != torch.float16:  # fp16 never passes the limit
        bad |= blocks.abs() > limit
    if bool(bad.any()):
        units, flags = blocks.movedim(dim, 0), bad.movedim(dim, 0)
        first = int(flags.reshape(blocks.shape[dim], -1).any(dim=1).nonzero()[0, 0])
        where = tuple(int(i) for i in flags[first].nonzero()[0])
        value = float(units[first][where])
        held = ("NaN" if math.isnan(value) else f"{value:g}" if math.isinf(value)  # all digits: 458528.03 > 458528
                else f"{value:.9g}, beyond the |x| <= {limit:.9g} its codecs' scales reach")
        raise UserError(f"{what}: {unit} {first} holds {held} (at {list(where)} within it, its first such value), "
                        "which a quantised tier cannot store")


def block_list(
    blocks: torch.Tensor | Sequence[torch.Tensor], layout: KVLayout, count: int, what: str
) -> list[torch.Tensor]:
    """Normalizes a batch (one tensor or a sequence of per-block tensors) to per-block views.

    Raises:
        UserError: wrong count, dtype or shape of any block.
    """
    if isinstance(blocks, torch.Tensor):
        check_blocks(blocks, layout, count, what)
        return list(blocks.unbind(0))
    if not isinstance(blocks, (list, tuple)):
        raise UserError(f"{what}: expected a tensor or a list of tensors, got {type(blocks).__name__}")
    if len(blocks) != count:
        raise UserError(f"{what}: expected {count} blocks, got {len(blocks)}")
    dtype, shape = torch_dtype(layout.dtype), layout.block_shape
    for i, block in enumerate(blocks):
        if not isinstance(block, torch.Tensor) or block.dtype != dtype or block.shape != shape:
            check_blocks(block.unsqueeze(0) if isinstance(block, torch.Tensor) else block, layout, 1, f"{what}[{i}]")
    return list(blocks)


def check_capacity_blocks(capacity_blocks: object, where: str) -> int:
    """A pool's capacity: an int (not a bool) of at least one block.

    Raises:
        UserError: naming ``where`` and whether the value is not an integer or below one.
    """
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int):
        raise UserError(f"{where}: capacity must be an integer number of blocks, got {capacity_blocks!r} "
                        f"({type(capacity_blocks).__name__})")
    if capacity_blocks < 1:
        raise UserError(f"{where}: capacity must be at least one block, got {capacity_blocks!r}")
    return capacity_blocks
