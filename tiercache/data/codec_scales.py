"""Group scales of the INT8 and INT4 codecs (``codecs.py``): fp16 ``absmax / 127`` (INT8)
and INT4's 7-bit scale and zero point, in plain torch (``codec_base._scale16_into`` and
``_asym_into`` are their compiled twins: the same float32 operations, the same bytes).

Invariants: every scale is a positive finite fp16 (1 for an all-zero group) as long as the
group's values are below ``codec_base.SCALED_LIMIT``; an INT4 zero point lies in [0, 15].
"""

from __future__ import annotations

import torch

from .codec_base import int4_scale


def _finite(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) clamped in place to ``dtype``'s finite range: a value within half a
    quantisation step of fp16's largest (65504) must not decode to infinity."""
    if dtype in (torch.float16, torch.bfloat16):
        limit = torch.finfo(dtype).max
        x.clamp_(-limit, limit)
    return x


def _sym_scale16(grouped: torch.Tensor, dim: int) -> torch.Tensor:
    """fp16 ``absmax / 127`` per group along ``dim`` (``_scale16``); codes are computed with
    this rounded scale, so the rounding adds no error."""
    return _scale16(grouped.abs().amax(dim=dim, keepdim=True).float(), 127)


#: fp16's spacing below 2^-14 (its subnormal range): its smallest positive value.
_HALF_STEP = 2.0 ** -24


def _scale16(amax: torch.Tensor, qmax: int) -> torch.Tensor:
    """fp16 scale ``amax / qmax`` (float32 division first) of each group (``amax >= 0``: its
    absmax or range), 1 where ``amax`` is 0 (an all-zero group encodes to zeros).

    The nearest fp16, as fp16 rounds, except where ``amax`` would then lie beyond
    ``qmax + 0.5`` scales: there the next fp16 up. That only happens below 2^-14 (fp16's
    subnormal range, spaced 2^-24; a normal fp16 is at most 2^-11 off), where the nearest
    alone could fall far short (the largest values clipped) or to 0 (every value of the
    group flushed to 0: INT8 groups of absmax < 3.8e-6). So the scale is at most
    ``amax / qmax + 2^-24`` (a normal one at most 2^-11 above it), an INT8 code is within
    half a step of its value (error at most about ``amax / 254 + 2^-25``), and normal
    scales are the nearest, as they always were (same bytes). The compiled
    ``codec_kernels.half_scales`` does the same float32 operations.
    """
    nearest = (amax / qmax).to(torch.float16).float()
    short = nearest * (qmax + 0.5) < amax
    scale = torch.where(short, nearest + _HALF_STEP, nearest).to(torch.float16)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _asym_params(grouped: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale fp16, zero uint8)`` per group along ``dim``; the range always holds 0, so the
    zero point lies in [0, 15] and an exact 0 stays exact."""
    return _asym_from(grouped.amin(dim=dim, keepdim=True).float(), grouped.amax(dim=dim, keepdim=True).float())


def _asym_from(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_asym_params`` from each group's float32 min and max."""
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scale = int4_scale(lo, hi, _scale16(hi - lo, 15).float()).to(torch.float16)
    zero = (-lo / scale.float()).round_().clamp_(0, 15).to(torch.uint8)
    return scale, zero
