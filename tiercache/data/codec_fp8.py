"""FP8 (e4m3) helpers of ``codecs.Fp8Codec``: its scale, the bound that keeps its exact key
channels picked once a block is decoded, and a fast e4m3 -> fp16 view.

Invariant: ``encode(decode(q)) == q`` for an FP8 block ``q`` of ordinary magnitude (its
scale and its exact channels come back from the decoded block; ``fp8_scale``,
``fp8_bounds`` say why).
"""

from __future__ import annotations

import torch

from . import codec_kernels as kernels

__all__ = ["FP8_MAX", "fp8_scale", "fp8_bounds", "fp8_as_fp16"]

#: The largest finite float8_e4m3fn.
FP8_MAX = 448.0


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """FP8 scale of each ``amax``: the largest float32 of 21 significant bits at or below
    ``amax / 448`` (1 where ``amax`` is 0).

    Why 21 bits: ``448 * scale`` (448 = 7 * 2^6) is then exact in float32, at most ``amax``
    and within 2^-20 of it, so the largest code decodes back to ``amax`` itself (fp16,
    bf16) or to ``448 * scale`` (fp32), from which this gives the same scale again: a
    decoded block re-encodes to the same bytes. The scale is at most 2^-20 (relative)
    below ``amax / 448``: no error figure of the codec moves.
    """
    amax = amax.float()
    scale = (amax / FP8_MAX).view(torch.int32).bitwise_and(~7).view(torch.float32)
    scale = torch.where(scale * FP8_MAX > amax, (scale.view(torch.int32) - 8).view(torch.float32), scale)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


#: The finite non-negative e4m3 values, ascending (codes 0x00-0x7E).
_E4M3_VALUES = torch.from_numpy(kernels.LUT_E4M3[:0x7F].copy())


def fp8_bounds(k_scale: torch.Tensor, picked: torch.Tensor, channels: torch.Tensor, dim: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The largest scaled magnitude each key channel of each (leading index, head) may
    encode to: ``[..., H, dim]`` e4m3 values, from the K ``k_scale`` (float32, ``[..., 1, 1]``),
    the absmax of each exact channel ``picked`` (``[..., H, n]``) and their ascending
    indices ``channels`` (``[..., H, n]``).

    The bound keeps a decoded non-exact channel from overtaking an exact one, so a
    re-encode picks the same channels (``codecs._top_channels``: larger absmax first, then lower
    index): with ``m`` the smallest exact absmax, a channel above the last exact channel
    of absmax ``m`` may decode to ``m`` (it loses the tie), one below it stays under ``m``.
    A channel's absmax was at most ``m``, so the bound only takes back a rounding up past
    ``m`` (at most one e4m3 step, only within a step of ``m``), or, for a channel whose
    absmax ties ``m`` below that last one, one step down from ``m``.
    """
    values = _E4M3_VALUES.to(k_scale.device)
    smallest = picked.amin(dim=-1, keepdim=True)
    decoded = (values * k_scale).to(dtype).float()  # [..., 1, codes]: what each code decodes to
    at_most = values[((decoded <= smallest).sum(dim=-1, keepdim=True) - 1).clamp_(min=0)]
    below = values[((decoded < smallest).sum(dim=-1, keepdim=True) - 1).clamp_(min=0)]
    last = torch.where(picked == smallest, channels.long(), -1).amax(dim=-1, keepdim=True)
    above = torch.arange(dim, device=picked.device) > last
    return torch.where(above, at_most, below)


def fp8_as_fp16(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes as fp16 values 256 times smaller, exactly (NaN codes excepted).

    Why: torch's own float8 -> float conversion runs ~4x slower on the CPU than these integer
    ops. The e4m3 sign, exponent and mantissa bits moved into fp16's fields give
    ``2^(e - 15) (1 + m / 8)``, and fp16 subnormals give ``2^-14 m / 8``: each the e4m3 value
    (bias 7, subnormal ``2^-6 m / 8``) times ``2^-8``.
    """
    bits = codes.view(torch.uint8).to(torch.int16)
    sign = (bits & 0x80).bitwise_left_shift_(8)
    return bits.bitwise_and_(0x7F).bitwise_left_shift_(7).bitwise_or_(sign).view(torch.float16)
