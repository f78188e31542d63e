"""The refined key channels of INT8 and INT4 (``codecs.Int8Codec``, ``codecs.Int4Codec``):
which channels are refined, and their residuals, in plain torch and as compiled loops.

Per (leading index, head) of a block, the 4 key channels of largest *coarse* absmax are
refined: the absmax each channel decodes to from its group scales (and zero points) and
coarse codes alone (``int8_coarse_amax``, ``int4_coarse_amax``). Those map back when a
decoded block is re-encoded (INT8: ``_scale16``; INT4: ``codec_base.int4_scale``), whether
the channel was refined or not, so a re-encode picks the same channels (the block's own
absmax did not: a decoded unrefined channel, rounded up to its coarse range, could overtake
a refined one, and the set changed for several re-encodes).

A refined value is ``steps`` fine steps of its scale (INT8: ``scale / 254``, INT4: ``scale /
16``), its code and residual a function of ``steps`` alone, and its group's extremes are
chosen so the decoded group maps back to the same scale (and zero point): where its
refined extremes, decoded, would not (``int8_pins``, ``int4_pins``), they take values that
do (INT4: the nearest refined steps that do, else their coarse values; INT8: their coarse
values, as an unrefined group's), and the group's other values are clamped between them. So a decoded block re-encodes to the same
bytes (blocks of ordinary magnitude: groups on fp16's subnormal grid excepted; in bf16, where two
INT4 fine steps of a large refined value round to one bf16 value, the first re-encode may take
the other's nibble: the same value, and stable bytes from then on).

Invariant: the compiled loops (``int8_fine``, ``int4_fine``) do the reference's float32
operations in its order: both paths give the same bytes.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from .codec_kernels import _JIT  # the codec kernels' compile options (disk cache where usable)
from .codec_scales import _asym_from, _finite, _scale16

__all__ = ["top_channels", "channel_groups", "per_token", "channel_scales", "int8_coarse_amax", "int4_coarse_amax",
           "int8_pins", "int4_pins", "int8_steps", "int4_steps", "int4_level_fine", "int8_fine", "int4_fine"]

def top_channels(amax: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` channels of largest ``amax`` (``[..., heads, 1, dim]``), ascending; of
    channels of equal ``amax``, the lowest indices (a fixed rule, unlike ``topk``'s, so a
    decoded block whose picked channels still lead, or tie at a higher index, picks them
    again)."""
    n = min(count, amax.shape[-1])
    order = amax.float().argsort(dim=-1, descending=True, stable=True)
    return order[..., :n].sort(dim=-1).values


def channel_groups(t: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """The columns ``channels`` (``[..., H, 1, n]``) of a per-group K statistic ``t``
    (``[..., H, T/g, 1, D]``): ``[..., H, T/g, 1, n]``."""
    *lead, groups, _, _ = t.shape
    return t.gather(-1, channels.unsqueeze(-3).expand(*lead, groups, 1, channels.shape[-1]))


def per_token(picked: torch.Tensor, tokens: int) -> torch.Tensor:
    """A per-group statistic of the refined channels ``[..., H, T/g, 1, n]`` as float32 for
    every token: ``[..., H, T, n]``."""
    *lead, groups, _, n = picked.shape
    return picked.float().expand(*lead, groups, tokens // groups, n).reshape(*lead, tokens, n)


def channel_scales(k_scale: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The float32 K scale (or any per-group K statistic) of every (token, refined channel)
    of ``index`` (``[..., H, T, n]``, the same channels for every token)."""
    return per_token(channel_groups(k_scale, index[..., :1, :]), index.shape[-2])


def int8_coarse_amax(amax: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """INT8: the absmax a group of absmax ``amax`` decodes to from its coarse codes alone,
    ``min(round(amax / scale), 127) * scale`` (float32)."""
    return (amax.float() / scale.float()).round_().clamp_(max=127).mul_(scale.float())


def int4_coarse_amax(lo: torch.Tensor, hi: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """INT4: the absmax a group of min ``lo`` and max ``hi`` decodes to from its coarse codes
    alone (those of ``min(lo, 0)`` and ``max(hi, 0)``; a group spanning all 16 codes gives
    ``scale * max(zero, 15 - zero)``), float32."""
    scale, zero = scale.float(), zero.float()
    bottom = (lo.float().clamp(max=0) / scale).round_().add_(zero).clamp_(0, 15)
    top = (hi.float().clamp(min=0) / scale).round_().add_(zero).clamp_(0, 15)
    return torch.maximum(zero - bottom, top - zero).mul_(scale)


def int8_pins(amax: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fine: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax, bound)`` of each refined INT8 group of absmax ``amax`` and fp16 ``scale``
    (``int8_steps``): where the refined absmax, decoded to ``dtype``, would not map back to
    ``scale`` (``_scale16``), the group's absmax takes its coarse value (``bound =
    min(round(amax / scale), 127) * fine`` steps) and the rest are clamped within it (at most
    half a scale lost on those values); elsewhere ``amax`` NaN and ``bound`` infinite."""
    scale32, amax = scale.float(), amax.float()
    steps = (amax / scale32).mul_(fine).round_()
    code = (steps / fine).round_().clamp_(-127, 127)
    residual = (steps - code * fine).clamp_(-127, 127)
    decoded = _finite((code + residual / fine) * scale32, dtype).to(dtype).float()
    keep = _scale16(decoded, 127) == scale
    bound = (amax / scale32).round_().clamp_(max=127).mul_(fine)
    return torch.where(keep, float("nan"), amax), torch.where(keep, float("inf"), bound)


def int4_pins(lo: torch.Tensor, hi: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype,
              fine: float) -> tuple[torch.Tensor, ...]:
    """``(lo, hi, bottom, top)`` of each refined INT4 group of min ``lo``, max ``hi``, fp16
    ``scale`` and zero point ``zero`` (``int4_steps``): where the group's refined extremes,
    decoded to ``dtype``, would not map back to its scale and zero point (``_asym_from``),
    its min and max take the nearest refined steps that do (``bottom``, ``top``: moved by at
    most 2 steps, ``_NEAR``; an end of zero steps is never moved: it decodes as 0), else
    their coarse values (as an unrefined group's, which map back: ``codec_base.int4_scale``),
    and every other value is clamped between them;
    elsewhere ``lo``, ``hi`` NaN and the bounds infinite (nothing pinned)."""
    scale32, zero32 = scale.float(), zero.float()
    ends = (lo.float().clamp(max=0), hi.float().clamp(min=0))
    steps = [(v / scale32).mul_(fine).round_() for v in ends]
    moves = _NEAR.view(-1, 2, *([1] * lo.dim())).to(lo.device)  # [candidates, (bottom, top), ...]: (0, 0) first
    # An end of zero steps stays at 0, as a zero end does: it decodes as 0 like the rest of a
    # tiny group (a fine step off it would be ~1e21 times a 1e-30 value).
    bottom = steps[0] + torch.where(steps[0] < 0, moves[:, 0], 0.0)
    top = steps[1] + torch.where(steps[1] > 0, moves[:, 1], 0.0)
    decoded = [_finite((level + residual / fine) * scale32, dtype).to(dtype).float()
               for level, residual in (int4_level_fine(t, zero32, fine) for t in (bottom, top))]
    again_scale, again_zero = _asym_from(*decoded)
    ok = (again_scale.float() == scale32) & (again_zero.float() == zero32)
    first = ok.to(torch.uint8).argmax(dim=0, keepdim=True)  # the nearest move that maps back
    found = ok.any(dim=0)
    coarse = [(v / scale32).round_().add_(zero32).clamp_(0, 15).sub_(zero32).mul_(fine) for v in ends]
    keep = ok[0]
    nan, inf = float("nan"), float("inf")
    bottom = torch.where(found, bottom.gather(0, first)[0], coarse[0])
    top = torch.where(found, top.gather(0, first)[0], coarse[1])
    return (torch.where(keep, nan, ends[0]), torch.where(keep, nan, ends[1]),
            torch.where(keep, -inf, bottom), torch.where(keep, inf, top))


#: Moves (bottom, top), in steps, of a pinned INT4 group's refined extremes, nearest first.
_NEAR = torch.tensor(sorted(((db, dt) for db in range(-2, 3) for dt in range(-2, 3)), key=lambda p: (abs(p[0]) + abs(p[1]), p)),
                     dtype=torch.float32)


def int8_steps(x: torch.Tensor, scale: torch.Tensor, ends: tuple[torch.Tensor, torch.Tensor], fine: float) -> torch.Tensor:
    """INT8 refined ``steps = round(x / scale * fine)`` (float32); ``ends = (amax, bound)``
    per value (``int8_pins``): a value of magnitude ``amax`` takes ``bound`` (signed),
    every other is clamped to ``[-bound, bound]``."""
    amax, bound = ends
    steps = (x.float() / scale).mul_(fine).round_()
    return torch.where(x == amax, bound, torch.where(x == -amax, -bound, torch.minimum(torch.maximum(steps, -bound), bound)))


def int4_steps(x: torch.Tensor, scale: torch.Tensor, ends: tuple[torch.Tensor, ...], fine: float) -> torch.Tensor:
    """INT4 refined ``steps = round(x / scale * fine)`` (float32); ``ends = (lo, hi, bottom,
    top)`` per value (``int4_pins``): a value equal to ``lo`` (``hi``) takes ``bottom``
    (``top``), every other is clamped to ``[bottom, top]``."""
    lo, hi, bottom, top = ends
    steps = (x.float() / scale).mul_(fine).round_()
    return torch.where(x == lo, bottom, torch.where(x == hi, top, torch.minimum(torch.maximum(steps, bottom), top)))


def int4_level_fine(steps: torch.Tensor, zero: torch.Tensor, fine: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(level, residual)`` of INT4 refined ``steps``: ``level = clamp(floor((steps + fine / 2)
    / fine) + zero, 0, 15) - zero`` (the code is ``level + zero``), ``residual = clamp(steps -
    fine * level, -fine / 2, fine / 2 - 1)``; a function of ``steps`` alone (a value half a code
    between two has one encoding)."""
    level = ((steps + fine / 2) / fine).floor_().add_(zero).clamp_(0, 15).sub_(zero)
    return level, (steps - level * fine).clamp_(-fine / 2, fine / 2 - 1)


@numba.njit(**_JIT)
def int8_fine(x, lut, gk, k_scale, channels, ends, codes, fine):
    """The int8 residual of the key channels ``channels[n, h, j]`` into ``fine[n, h, t, j]``,
    their codes rewritten (``int8_steps`` with ``ends[:, n, h, t // gk, j]``, then ``code = clamp(round(steps / 254), -127,
    127)``, ``fine = clamp(steps - 254 * code, -127, 127)``: ``Int8Codec._fine``'s float32
    operations in its order)."""
    n_, _, heads, tokens, _ = x.shape
    f = np.float32(254.0)
    for n in range(n_):
        for h in range(heads):
            for t in range(tokens):
                for j in range(channels.shape[2]):
                    c = channels[n, h, j]
                    s, v = k_scale[n, h, t // gk, c], lut[x[n, 0, h, t, c]]
                    a, bound = ends[0, n, h, t // gk, j], ends[1, n, h, t // gk, j]
                    steps = bound if v == a else (-bound if v == -a else min(max(np.rint(v / s * f), -bound), bound))
                    code = min(max(np.rint(steps / f), np.float32(-127.0)), np.float32(127.0))
                    codes[n, 0, h, t, c] = np.int8(code)
                    fine[n, h, t, j] = np.int8(min(max(steps - code * f, np.float32(-127.0)), np.float32(127.0)))


@numba.njit(**_JIT)
def int4_fine(x, lut, gk, k_scale, k_zero, channels, ends, packed, payload):
    """The 4-bit residuals of the key channels ``channels[n, h, j]``, two a byte into the
    flat ``packed`` (element ``2i`` of the ``[n, h, t, j]`` order in the low nibble; a last
    odd element alone), their codes rewritten in ``payload`` ``[n, 2, heads, tokens, dim //
    2]``: ``int4_steps`` with ``ends[:, n, h, t // gk, j]`` (lo, hi, bottom, top), then
    ``int4_level_fine`` (the float32 operations of ``Int4Codec._refinement``, in its order)."""
    n_, _, heads, tokens, _ = x.shape
    f, half = np.float32(16.0), np.float32(8.0)
    i = 0
    for n in range(n_):
        for h in range(heads):
            for t in range(tokens):
                for j in range(channels.shape[2]):
                    c, g = channels[n, h, j], t // gk
                    s, z, v = k_scale[n, h, g, c], k_zero[n, h, g, c], lut[x[n, 0, h, t, c]]
                    lo, hi, bottom, top = ends[0, n, h, g, j], ends[1, n, h, g, j], ends[2, n, h, g, j], ends[3, n, h, g, j]
                    steps = bottom if v == lo else (top if v == hi else min(max(np.rint(v / s * f), bottom), top))
                    level = min(max(np.floor((steps + half) / f) + z, np.float32(0.0)), np.float32(15.0)) - z
                    nibble = np.uint8(min(max(steps - level * f, -half), half - np.float32(1.0)) + half)
                    packed[i // 2] = nibble if i % 2 == 0 else packed[i // 2] | (nibble << np.uint8(4))
                    code, byte = np.uint8(level + z), payload[n, 0, h, t, c // 2]
                    payload[n, 0, h, t, c // 2] = (byte & np.uint8(0xF0)) | code if c % 2 == 0 else (byte & np.uint8(15)) | (code << np.uint8(4))
                    i += 1
