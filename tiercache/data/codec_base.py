"""The block codec contract and what every codec shares (``codecs.py`` has the codecs).

``BlockCodec`` turns a KV block ``[..., 2, kv_heads, block_tokens, head_dim]`` into a
``QuantizedBlock`` (a payload and its scales, described part by part by ``parts``) and
back, with a plain torch reference path (any device) beside each codec's compiled fast path
(CPU fp16/bf16 blocks). A ``QuantizedBlock`` serialises to one flat uint8 buffer of exactly
``nbytes`` bytes, wider dtypes first, so every part of a buffer read back is aligned for a
zero-copy view.

Invariants: inputs are finite; ``nbytes_of`` is exactly what ``encode`` holds.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..config import Codec, KVLayout
from ..errors import UserError
from . import codec_kernels as kernels

__all__ = ["Part", "QuantizedBlock", "BlockCodec", "check_block", "FLOAT_DTYPES", "UnencodableError", "INT4_MAX_CLIP_STEPS"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Part:
    """One tensor of a quantised block: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of this part."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class QuantizedBlock:
    """A block as a codec stores it.

    Invariants: ``(payload, *scales)`` match ``codec_for(codec).parts(shape, dtype)`` one to one,
    in that order, each contiguous; ``shape``/``dtype`` are those of the block encoded.
    """

    codec: Codec
    shape: tuple[int, ...]
    dtype: torch.dtype
    payload: torch.Tensor
    scales: tuple[torch.Tensor, ...] = ()

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The payload then the scales, in ``parts`` order."""
        return (self.payload, *self.scales)

    @property
    def nbytes(self) -> int:
        """Bytes held, scales included (equals ``BlockCodec.nbytes_of(shape, dtype)``)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


def check_block(block: object, what: str = "block") -> torch.Tensor:
    """Returns ``block`` when it is a float KV block tensor.

    Raises:
        UserError: not a tensor, not fp16/bf16/fp32, or not ``[..., 2, heads, tokens, dim]``.
    """
    if not isinstance(block, torch.Tensor):
        raise UserError(f"{what}: expected a torch.Tensor, got {type(block).__name__}")
    if block.dtype not in FLOAT_DTYPES:
        raise UserError(f"{what}: dtype {block.dtype} is not one of float16, bfloat16, float32")
    if block.dim() < 4 or block.shape[-4] != 2 or block.numel() == 0:
        raise UserError(f"{what}: shape {tuple(block.shape)} is not [..., 2, kv_heads, block_tokens, head_dim] "
                        "(K and V as the two halves of the 2 dim, no empty dim)")
    return block


def _torch_dtype(name: str) -> torch.dtype:
    """The float torch dtype of a layout's dtype name."""
    dtype = getattr(torch, name, None)
    if dtype not in FLOAT_DTYPES:
        raise UserError(f"layout dtype {name!r}: the codecs take float16, bfloat16 or float32 blocks")
    return dtype


def _halves(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, int, int]:
    """``(leading dims, heads, tokens, head_dim)`` of a block shape."""
    *lead, _, heads, tokens, dim = shape
    return tuple(lead), heads, tokens, dim


def _fast_input(block: torch.Tensor) -> tuple[np.ndarray, bool] | None:
    """``(uint16 bits [n, 2, heads, tokens, dim], is_bf16)`` of a contiguous CPU fp16 or bf16
    block, what the compiled loops read and write; None for any other block."""
    if block.dtype not in (torch.float16, torch.bfloat16) or block.device.type != "cpu" or not block.is_contiguous():
        return None
    return block.view(torch.int16).numpy().view(np.uint16).reshape(-1, *block.shape[-4:]), block.dtype == torch.bfloat16


_POOL: ThreadPoolExecutor | None = None
_CPUS = os.cpu_count() or 1


def _forget_pool_in_child() -> None:
    """``os.register_at_fork`` child handler: a forked child has none of the parent's pool
    threads, so it starts its own pool (the inherited one would never run a task)."""
    global _POOL
    _POOL = None


os.register_at_fork(after_in_child=_forget_pool_in_child)


def _on_heads(kernel, heads: int, *args) -> None:
    """Runs ``kernel(*args, h0, h1)`` over two halves of the heads at once: one on a helper
    thread, one here (the kernels release the GIL; the machines this targets have a core or
    more per half). An argument that is a function gets the half's index (0, 1) and returns
    that half's own array (outputs the halves must not share)."""
    global _POOL
    halves = [(0, heads // 2, 0), (heads // 2, heads, 1)] if heads >= 2 and _CPUS >= 2 else [(0, heads, 0)]

    def run(h0: int, h1: int, part: int) -> None:
        kernel(*(a(part) if callable(a) else a for a in args), h0, h1)

    if len(halves) == 1:
        run(*halves[0])
        return
    if _POOL is None:
        _POOL = ThreadPoolExecutor(1, "tiercache-codec")
    other = _POOL.submit(run, *halves[1])
    run(*halves[0])
    other.result()


def _lut(bf16: bool) -> np.ndarray:
    """The float32 table of the block's 16-bit patterns (what the reductions return through)."""
    return kernels.LUT_BF16 if bf16 else kernels.LUT_F16


def _all_finite(*arrays: np.ndarray | torch.Tensor) -> bool:
    """Whether every value of every array (numpy or torch) is finite."""
    return all(bool(np.isfinite(a).all()) if isinstance(a, np.ndarray) else bool(torch.isfinite(a).all()) for a in arrays)


class UnencodableError(UserError):
    """A block holds values a codec cannot store: inf or NaN, or (INT8, INT4) values too large
    for its fp16 scales. Raised by ``encode`` and ``encode_into`` for the block itself, never
    for a bad argument (those raise plain ``UserError``), so a caller moving stored blocks
    can tell a block no quantised tier can hold from a bug."""


def _require_finite(*stats: np.ndarray | torch.Tensor) -> None:
    """Raises UnencodableError unless every value of ``stats`` is finite. Given a block's
    reductions (absmax, min, max), an inf or NaN anywhere in the block shows up in them,
    at no extra pass over the block."""
    if not _all_finite(*stats):
        raise UnencodableError("encode: the block holds inf or NaN values; the codecs take finite blocks")


#: Largest |x| the INT4 codec takes, the lower of the two fp16-scaled codecs' bounds: its
#: scales are fp16 (range / 15, at most 65504); every fp16 block fits, a bf16 or fp32 one may not.
SCALED_LIMIT = 65504.0 * 7

#: Largest |x| a quantised tier's check lets into the INT8 codec: its scales are fp16 too
#: (absmax / 127, at most 65504), and this bound, 253 * 2**15, lies just below 65504 * 127 and
#: is exact in bf16 (65504 * 127's nearest bf16, 8,323,072, would overflow the scale), so a
#: check in the block's own dtype never lets through a value the codec refuses.
INT8_LIMIT = 253.0 * 2**15


def _require_scales(*scales: np.ndarray | torch.Tensor) -> None:
    """Raises UnencodableError when an fp16 scale overflowed: the block's values are too large
    for the codec (one inf scale would decode its whole group as NaN)."""
    if not _all_finite(*scales):
        raise UnencodableError(f"encode: the block holds values too large for the codec's fp16 scales (INT8 takes "
                               f"every block of |x| < {65504 * 127}, INT4 every block of |x| < {SCALED_LIMIT:g}; "
                               "every fp16 block fits)")


def _scale16_into(amax: np.ndarray, qmax: int, part: torch.Tensor) -> np.ndarray:
    """fp16 scales ``amax / qmax`` exactly as ``codecs._scale16`` makes them (float32
    division, rounded to nearest even, the next fp16 up where a subnormal nearest falls
    short; 1 where ``amax`` is 0) written into the fp16 ``part`` (same element order);
    returns the scales as float32, ``amax``'s shape."""
    values = np.empty(amax.shape, np.float32)
    kernels.half_scales(amax.reshape(-1), np.float32(qmax), _bits(part), values.reshape(-1))
    _require_scales(values)
    return values


def _asym_into(lo: np.ndarray, hi: np.ndarray, scale_part: torch.Tensor,
               zero_part: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``codecs._asym_from`` compiled (the same float32 operations: ``half_scales``, then
    ``int4_scales`` where ``int4_scale`` takes its 7-bit scale): the fp16 scale and uint8
    zero point of each group of float32 min ``lo`` and max ``hi``, written into the parts;
    returns both as float32 arrays of ``lo``'s shape."""
    lo, top = np.minimum(lo, np.float32(0.0)).reshape(-1), np.maximum(hi, np.float32(0.0)).reshape(-1)
    scale, zero = np.empty(lo.shape, np.float32), np.empty(lo.shape, np.float32)
    with np.errstate(over="ignore"):  # a range past float32's max is inf: its scale is refused below
        spread = top - lo
    kernels.half_scales(spread, np.float32(15.0), _bits(scale_part), scale)  # the fallback
    kernels.int4_scales(lo, top, _bits(scale_part), scale)
    _require_scales(scale)
    kernels.zero_points(lo, scale, zero_part.numpy().reshape(-1), zero)
    return scale.reshape(hi.shape), zero.reshape(hi.shape)


#: Most a value of an INT4 group is clipped by, in steps of its group's scale ``c``, where
#: ``c >= 2^-18`` (groups of range above ~6e-5; below, at most one step of ``c``): every
#: other value is within half a step. 7-bit scales are 1-2% apart, so ``r / c`` strays from
#: 15 and a group's extremes may lie past its end codes by more than half a step:
#: ``hi / c + zero - 15 <= r / c - 14.5 < 15 / ((1 - 2^-9) (1 - 2^-6)) - 14.5 = 0.768``
#: (``int4_scale``'s second candidate; the first gives < 0.68). Measured: at most 0.66 on
#: N(0, 1) groups of 64 (~5% of groups clip an extreme by more than half a step, ~0.08% of
#: values), 0.73 on adversarial ones.
INT4_MAX_CLIP_STEPS = 0.77


def int4_scale(lo: torch.Tensor, hi: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """INT4's float32 scale of each group of min ``lo <= 0`` and max ``hi >= 0`` (range
    ``r = hi - lo``): ``c = floor7(r / 15 * (1 + 2^-8))`` where it spans all 16 codes, else
    ``floor7(r / 15 * (1 - 2^-9))`` where that does, else ``fallback`` (``_scale16(r, 15)``);
    ``floor7`` rounds down to 7 significant bits, then to fp16's grid (multiples of 2^-24).
    "Spans": ``lo`` gets code 0 and ``hi`` code 15 (zero point ``round(-lo / c)``), and
    ``15.5 * c >= r``. A value beyond an end code is clipped to it: by up to
    ``INT4_MAX_CLIP_STEPS`` (0.77) of a step, not half (``hi``'s unclamped code may be 16).
    For ~4% of N(0, 1) groups of 64 no 7-bit scale near ``r / 15`` (with any zero point)
    spans all codes within half a step, and a scale that does not span would shrink the
    group at every re-encode.

    Invariant: a decoded group maps back to its scale (so INT4 re-encodes it to the same
    bytes). Its codes span 0..15, so its range is ``15 * c`` (fp16 and fp32 blocks hold
    ``(code - zero) * c`` exactly: 4 + 7 bits; bf16 within 2^-8 of it), and ``c``, a 7-bit
    value, is ``floor7`` of anything in ``[c, c * (1 + 2^-7))``: ``r / 15 * (1 + 2^-8)``
    lies there (checked exhaustively for bf16's rounding). The second candidate, strictly
    below ``r / 15``, spans all codes whenever the first does not (the first may fall short
    by a rounding; the exact ``r / 15`` by a tie). Only groups whose scale would be
    under ~30 * 2^-24 (range below ~2.7e-5, where fp16's grid is coarser than 7 bits)
    take the fallback, which need not map back. ``codec_kernels.int4_scales`` does the same
    float32 operations."""
    r = hi - lo
    scale = fallback
    for factor in (kernels.INT4_DOWN, kernels.INT4_UP):  # UP last: it wins where both span all codes
        bits = (r / 15 * float(factor)).view(torch.int32) & int(kernels.INT4_SCALE_MASK.view(np.int32))
        c = torch.floor(bits.view(torch.float32) * 2.0**24) * 2.0**-24
        z = (-lo / c).round().clamp(0, 15)
        spans = (c > 0) & (c * 15.5 >= r) & ((lo / c).round() + z <= 0) & ((hi / c).round() + z >= 15)
        scale = torch.where(spans, c, scale)
    return scale


def _bits(part: torch.Tensor) -> np.ndarray:
    """A contiguous fp16 CPU tensor's bits as a flat uint16 numpy view (writes land in it)."""
    return part.view(torch.int16).numpy().view(np.uint16).reshape(-1)


def _f32(t: torch.Tensor, *shape: int) -> np.ndarray:
    """A small CPU tensor (scales, zero points) as a float32 numpy array of ``shape``."""
    return t.to(torch.float32).reshape(shape).numpy()


class BlockCodec(ABC):
    """Encodes blocks into ``QuantizedBlock`` and back; one stateless instance per codec."""

    codec: Codec

    @abstractmethod
    def parts(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Part, ...]:
        """The tensors of an encoded block of ``shape``/``dtype``: payload first, then scales."""

    @abstractmethod
    def _encode(self, block: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``(payload, scales)`` of a checked block."""

    @abstractmethod
    def _decode(self, q: QuantizedBlock, out: torch.Tensor) -> None:
        """Writes the dequantised block into ``out`` (checked: same shape as ``q``)."""

    def _fast_ok(self, shape: tuple[int, ...]) -> bool:
        """Whether ``_encode_fast`` takes a CPU fp16/bf16 block of ``shape`` (False: no
        compiled encode)."""
        return False

    def _encode_fast(self, q: QuantizedBlock, block: torch.Tensor, x: np.ndarray, bf16: bool) -> None:
        """Writes the encoding of ``block`` into ``q``'s tensors (contiguous CPU views of one
        byte buffer, ``parts`` order) by compiled loops; only called where ``_fast_ok``.
        ``x`` is the block's uint16 bits ``[n, 2, heads, tokens, dim]`` (fp16, or bf16)."""
        raise NotImplementedError

    def _decode_fast(self, q: QuantizedBlock, out: torch.Tensor, bits: np.ndarray, bf16: bool) -> bool:
        """Dequantises into ``out`` (a contiguous CPU fp16/bf16 block; ``bits`` its uint16 view
        ``[n, 2, heads, tokens, dim]``) by a faster path than ``_decode``, with the same
        result (the whole block: nothing is left to do after it); False where the codec
        has none."""
        return False

    def encode(self, block: torch.Tensor) -> QuantizedBlock:
        """Quantises ``block`` (``[..., 2, heads, tokens, head_dim]``, fp16/bf16/fp32).

        Raises:
            UserError: ``block`` is not such a tensor; ``UnencodableError`` (a UserError)
                when it holds inf or NaN, or values beyond ``INT8_LIMIT`` (INT8) or ``SCALED_LIMIT`` (INT4).
        """
        check_block(block)
        fast = self._fast_bits(block)
        if fast is not None:  # one fresh buffer: every part's view is aligned in it
            buf = torch.empty(self.nbytes_of(tuple(block.shape), block.dtype), dtype=torch.uint8)
            q = self.from_bytes(buf, tuple(block.shape), block.dtype)
            self._encode_fast(q, block, *fast)
            return q
        _require_finite(block)
        payload, scales = self._encode(block)
        return QuantizedBlock(self.codec, tuple(block.shape), block.dtype, payload, scales)

    def _fast_bits(self, block: torch.Tensor) -> tuple[np.ndarray, bool] | None:
        """``_fast_input(block)`` where this codec has a compiled encode for it, else None."""
        return _fast_input(block) if self._fast_ok(tuple(block.shape)) else None

    def encode_reference(self, block: torch.Tensor) -> QuantizedBlock:
        """``encode`` in plain torch (the reference the compiled loops are checked against)."""
        check_block(block)
        _require_finite(block)
        payload, scales = self._encode(block)
        return QuantizedBlock(self.codec, tuple(block.shape), block.dtype, payload, scales)

    def decode(self, q: QuantizedBlock, out: torch.Tensor) -> torch.Tensor:
        """Dequantises ``q`` into ``out`` (same shape, any float dtype) and returns ``out``.

        Raises:
            UserError: ``q`` is another codec's, or ``out`` is not a float tensor of ``q.shape``.
        """
        self._check_decode(q, out)
        fast = _fast_input(out) if q.payload.device.type == "cpu" else None
        if fast is None or not self._decode_fast(q, out, *fast):
            self._decode(q, out)
        return out

    def decode_reference(self, q: QuantizedBlock, out: torch.Tensor) -> torch.Tensor:
        """``decode`` in plain torch (the reference the compiled loops are checked against)."""
        self._check_decode(q, out)
        self._decode(q, out)
        return out

    def _check_decode(self, q: QuantizedBlock, out: torch.Tensor) -> None:
        if not isinstance(q, QuantizedBlock) or q.codec is not self.codec:
            raise UserError(f"decode: expected a {self.codec.value} QuantizedBlock, got {getattr(q, 'codec', q)!r}")
        check_block(out, "out")
        if tuple(out.shape) != q.shape:
            raise UserError(f"decode: out has shape {tuple(out.shape)}, the block {q.shape}")

    def _check_buffer(self, buf: object, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
        _check_buffer_impl(self, buf, shape, dtype, what)

    def nbytes_of(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Exact bytes of an encoded block of ``shape``/``dtype``, scales included."""
        return sum(p.nbytes for p in self.parts(tuple(shape), dtype))

    def nbytes(self, layout: KVLayout) -> int:
        """Exact bytes of one encoded block of ``layout``, scales included."""
        return self.nbytes_of(layout.block_shape, _torch_dtype(layout.dtype))

    def to_bytes(self, q: QuantizedBlock) -> torch.Tensor:
        """``q`` as one flat uint8 tensor of ``nbytes_of(q.shape, q.dtype)`` bytes (a copy).

        Order: parts sorted by element size, widest first (stable), so ``from_bytes`` can view
        each part in place.
        """
        out = torch.empty(self.nbytes_of(q.shape, q.dtype), dtype=torch.uint8, device=q.payload.device)
        self._write_bytes(q, out)
        return out

    def _write_bytes(self, q: QuantizedBlock, out: torch.Tensor) -> None:
        """Writes ``q``'s parts into the uint8 ``out`` (its size checked), widest first."""
        parts = self.parts(q.shape, q.dtype)
        offset = 0
        for index in _byte_order(parts):
            tensor, nbytes = q.tensors[index], parts[index].nbytes
            out[offset:offset + nbytes].copy_(tensor.contiguous().view(-1).view(torch.uint8))
            offset += nbytes

    def encode_into(self, block: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """Quantises ``block`` straight into ``buf`` (``to_bytes`` of ``encode``, no
        intermediate buffer; ``buf`` may be on another device) and returns ``buf``.

        Raises:
            UserError: ``block`` is not a float KV block or is one ``encode`` refuses
                (``UnencodableError``), or ``buf`` not a 1-D uint8 tensor of
                ``nbytes_of(block.shape, block.dtype)`` bytes (a refused block may leave
                ``buf`` partly written).
        """
        check_block(block)
        self._check_buffer(buf, tuple(block.shape), block.dtype, "encode_into")
        fast = self._fast_bits(block) if buf.device.type == "cpu" else None
        views = None if fast is None else self._views_in(buf, tuple(block.shape), block.dtype)
        if views is None:
            self._write_bytes(self.encode(block), buf)
        else:  # the compiled loops write each part in place: no intermediate block
            self._encode_fast(views, block, *fast)
        return buf

    def _views_in(self, buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> QuantizedBlock | None:
        """``from_bytes(buf)`` when every part is a view of ``buf`` itself (a write into it
        lands in ``buf``); None where a misaligned part would have been a copy."""
        q = self.from_bytes(buf, shape, dtype)
        base = buf.untyped_storage().data_ptr()
        return q if all(t.untyped_storage().data_ptr() == base for t in q.tensors) else None

    def decode_from(self, buf: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> torch.Tensor:
        """Dequantises the bytes ``to_bytes``/``encode_into`` wrote for a ``dtype`` block of
        ``out``'s shape into ``out`` (any float dtype) and returns it.

        Raises:
            UserError: ``buf`` is not exactly that many bytes, or ``out`` not a float block.
        """
        return self.decode(self.from_bytes(buf, tuple(out.shape), dtype), out)

    def from_bytes(self, buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> QuantizedBlock:
        """The block that ``to_bytes`` wrote into ``buf``; its tensors are views of ``buf``
        (copies only where ``buf`` is misaligned for a part's dtype).

        Raises:
            UserError: ``buf`` is not a 1-D uint8 tensor of exactly ``nbytes_of(shape, dtype)``.
        """
        parts = self.parts(tuple(shape), dtype)
        self._check_buffer(buf, tuple(shape), dtype, "from_bytes")
        tensors: list[torch.Tensor | None] = [None] * len(parts)
        offset = 0
        for index in _byte_order(parts):
            part = parts[index]
            tensors[index] = _view(buf[offset:offset + part.nbytes], part)
            offset += part.nbytes
        return QuantizedBlock(self.codec, tuple(shape), dtype, tensors[0], tuple(tensors[1:]))


def _check_buffer_impl(codec: "BlockCodec", buf: object, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
    """Raises UserError unless ``buf`` is a 1-D uint8 tensor of the block's encoded size."""
    total = codec.nbytes_of(shape, dtype)
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != total:
        got = f"{buf.dtype} {tuple(buf.shape)}" if isinstance(buf, torch.Tensor) else type(buf).__name__
        raise UserError(f"{what}: expected a 1-D uint8 tensor of {total} bytes ({codec.codec.value}, "
                        f"shape {tuple(shape)}), got {got}")


def _byte_order(parts: tuple[Part, ...]) -> list[int]:
    """Indices of ``parts``, widest element first (stable): keeps every part aligned."""
    return sorted(range(len(parts)), key=lambda i: -parts[i].dtype.itemsize)


def _view(chunk: torch.Tensor, part: Part) -> torch.Tensor:
    """``chunk`` (uint8) viewed as ``part``; copied first when its address is misaligned."""
    if chunk.data_ptr() % part.dtype.itemsize:
        chunk = chunk.clone()
    return chunk.view(part.dtype).view(part.shape)
