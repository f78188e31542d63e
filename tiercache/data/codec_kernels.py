"""Compiled (numba) loops of the block codecs' hot paths, on the CPU.

Each kernel fuses what the torch reference in ``codecs.py`` does in several passes over the
block (reduce, divide, round, clamp, cast, pack), and computes every value with the same
float32 operations in the same order, so its output is bit-identical to the reference
(``tests/test_codec_kernels.py`` checks that on fresh random blocks). The small per-group
arithmetic (fp16 rounding of scales, zero points, top-k of channels) stays in torch: it
touches one value per group, not per element.

Which paths are compiled is measured, not assumed (``scripts/bench_quant.py`` times both
on one block): every encode, and INT4's decode (unpacking nibbles). INT8 and FP8 decode stay
in torch, whose passes convert to fp16 with the CPU's own instructions and ran several times
faster than these loops' integer rounding.

Every kernel works on the heads ``h0 <= h < h1`` (``codecs.py`` runs two halves of the
heads on two threads: the kernels release the GIL). Blocks come in and go out as the
uint16 bits of fp16 or bf16 ``[n, 2, heads, tokens, dim]`` (K then V; ``bf16`` says
which), converted to and from float32 one row of ``dim`` values at a time in a scratch row
(``_load``/``_store``: exact, and rounded to nearest even as torch rounds). Every inner loop runs over one contiguous row, so LLVM vectorises it. Kernels
release the GIL (``nogil``) so the NVMe store's I/O threads encode and decode blocks in
parallel; none uses numba's own thread pool (it may not be entered from several threads
at once).
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["LUT_F16", "LUT_BF16", "group_amax", "int8_encode", "group_minmax", "int4_encode",
           "int4_decode", "half_scales", "int4_scales", "zero_points", "channel_amax", "fp8_encode", "fp8_decode", "gather_channels", "scatter_channels"]


def _disk_cache_usable() -> bool:
    """Whether numba can keep this file's compiled code on disk: not where no cache folder is
    writable (a read-only install with no writable home); the kernels then compile in each
    process, silently (``tiercache.policies.kernels`` warns about the same once)."""
    try:
        numba.njit(cache=True)(lambda: None)  # a function of this file: numba looks for its cache folder
    except RuntimeError:  # "cannot cache function ...: no locator available for file ..."
        return False
    return True


# error_model "numpy": no ZeroDivisionError check per division (it stops LLVM vectorising;
# scales are never 0: an all-zero group gets scale 1).
_JIT = dict(nogil=True, cache=_disk_cache_usable(), boundscheck=False, error_model="numpy")
# The per-row helpers are inlined into the kernels (inline="always"): called per row as
# functions, each call's array arguments cost reference counting that LLVM cannot remove,
# and the rows were several times slower.


#: float32 value of every fp16 / bf16 bit pattern (what a reduction's result is turned into).
LUT_F16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
LUT_BF16 = (np.arange(65536, dtype=np.uint32) << np.uint32(16)).view(np.float32)
#: float32 value of every float8_e4m3fn code (0x7F and 0xFF are NaN).
LUT_E4M3 = np.array([(-1.0 if c & 0x80 else 1.0) * ((2.0 ** (((c >> 3) & 15) - 7)) * (1 + (c & 7) / 8) if (c >> 3) & 15
                     else 2.0 ** -6 * (c & 7) / 8) for c in range(256)], dtype=np.float32)
LUT_E4M3[[0x7F, 0xFF]] = np.nan

# Reductions (absmax, min, max) run on the 16-bit patterns as integers: for finite fp16 and
# bf16, |x| orders as ``bits & 0x7FFF`` and x as that magnitude signed by the sign bit. An
# integer max is exact in any order, so LLVM vectorises it; a float max keeps NaN
# semantics and stays one serial chain per group (~5x slower). One table lookup per group
# turns the result back into a float.


@numba.njit(inline="always", **_JIT)
def _key(bits):
    """An int32 that orders as the finite fp16/bf16 value of ``bits`` (-0 and +0 both 0)."""
    mag = np.int32(bits & np.uint16(0x7FFF))
    return -mag if bits & np.uint16(0x8000) else mag


@numba.njit(inline="always", **_JIT)
def _unkey(key, lut):
    """The float32 value of a ``_key``."""
    return lut[np.uint16(0x8000) | np.uint16(-key)] if key < 0 else lut[np.uint16(key)]


# ----- fp16 / bf16 rows <-> float32 rows, bit-exact, vectorised ---------------------------
#
# Helpers take the whole array and the row's indices, never a row slice: a slice is an array
# object whose reference count numba updates (two atomic calls) on every row, which cost
# more than the row's arithmetic.

_F16_TO_F32 = np.float32(2.0**112)  # rebias a fp16 exponent (15) moved into fp32's field (127)


@numba.njit(inline="always", **_JIT)
def _load(x, n, c, h, t, bf16, u32, f32):
    """The float32 values of the fp16 (or bf16) row ``x[n, c, h, t]`` into ``f32`` (a float32
    view of the scratch row ``u32``). fp16: exponent and mantissa moved into fp32's fields,
    times 2^112, exact for normals and subnormals (inputs are finite)."""
    dim = u32.shape[0]
    if bf16:
        for d in range(dim):
            u32[d] = np.uint32(x[n, c, h, t, d]) << np.uint32(16)
        return
    for d in range(dim):
        u32[d] = (np.uint32(x[n, c, h, t, d]) & np.uint32(0x7FFF)) << np.uint32(13)
    for d in range(dim):
        v = f32[d] * _F16_TO_F32
        f32[d] = -v if x[n, c, h, t, d] & np.uint16(0x8000) else v


@numba.njit(inline="always", **_JIT)
def _store(f32, u32, bf16, half_f32, half_u32, out, n, c, h, t):
    """The float32 row ``f32`` (``u32`` its bits) rounded to nearest even into the fp16 (or
    bf16) row ``out[n, c, h, t]``, as torch's conversion rounds; ``half_f32`` is a scratch
    row, ``half_u32`` its bits. fp16 (after F. Giesen's float_to_half_fast3_rtne): normals
    drop 13 mantissa bits, subnormals are rounded by adding 0.5, overflow is infinity, NaN
    stays NaN."""
    dim = f32.shape[0]
    if bf16:
        for d in range(dim):
            f = u32[d]
            rounded = (f + np.uint32(0x7FFF) + ((f >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            nan = (f & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
            out[n, c, h, t, d] = np.uint16(((f >> np.uint32(16)) | np.uint32(0x40)) if nan else rounded)
        return
    for d in range(dim):
        half_f32[d] = abs(f32[d]) + np.float32(0.5)
    for d in range(dim):
        f = u32[d]
        sign = (f >> np.uint32(16)) & np.uint32(0x8000)
        a = f & np.uint32(0x7FFFFFFF)
        normal = (a + np.uint32(0xC8000FFF) + ((a >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
        small = half_u32[d] - np.uint32(0x3F000000)
        big = np.uint32(0x7E00) if a > np.uint32(0x7F800000) else np.uint32(0x7C00)  # NaN, else infinity
        code = big if a >= np.uint32(143 << 23) else (small if a < np.uint32(113 << 23) else normal)
        out[n, c, h, t, d] = np.uint16(code | sign)


# ----- INT8 ------------------------------------------------------------------------------

@numba.njit(**_JIT)
def half_scales(num, den, bits, values):
    """Scales ``num / den`` (float32 division) as ``codecs._scale16`` makes them: the fp16
    rounded to nearest as torch rounds, the next fp16 up where ``num`` would lie beyond
    ``den + 0.5`` of it (only below 2^-14: no scale flushes to 0, no code clips far), 1
    where ``num`` is 0: their bits into ``bits`` (uint16) and their values into ``values``
    (float32); all 1-D of one length (``num >= 0``: absmax or range of each group)."""
    size = num.shape[0]
    u32, half_u32 = np.empty(size, np.uint32), np.empty(size, np.uint32)
    row, half_f32 = u32.view(np.float32), half_u32.view(np.float32)
    for i in range(size):
        row[i] = num[i] / den
    _store(row, u32, False, half_f32, half_u32, bits.reshape(1, 1, 1, 1, size), 0, 0, 0, 0)
    for i in range(size):
        short = LUT_F16[bits[i]] * (den + np.float32(0.5)) < num[i]  # positive: the next fp16 up is bits + 1
        bits[i] = bits[i] + np.uint16(1) if short else (bits[i] if bits[i] != 0 else np.uint16(0x3C00))
        values[i] = LUT_F16[bits[i]]


#: INT4 scales keep 7 significant bits (float32's 17 low ones cleared; ``codec_base.int4_scale``).
INT4_SCALE_MASK = np.uint32(0xFFFE0000)
INT4_UP, INT4_DOWN = np.float32(1.0 + 2.0**-8), np.float32(1.0 - 2.0**-9)


@numba.njit(inline="always", **_JIT)
def _spans_all_codes(lo, hi, c):
    """Whether scale ``c`` maps ``lo`` to code 0 and ``hi`` to code 15 (zero point
    ``round(-lo / c)``) with ``15.5 * c >= hi - lo`` (``codec_base.int4_scale``: a value past
    an end code may be clipped by up to ``codec_base.INT4_MAX_CLIP_STEPS`` of a step)."""
    z = min(max(np.rint(-lo / c), np.float32(0.0)), np.float32(15.0))
    return c > 0 and c * np.float32(15.5) >= hi - lo and np.rint(lo / c) + z <= 0 and np.rint(hi / c) + z >= 15


@numba.njit(**_JIT)
def int4_scales(lo, hi, bits, values):
    """INT4's 7-bit scales (``codec_base.int4_scale``, the same float32 operations) over the
    fp16 ``bits`` and float32 ``values`` of ``half_scales``, where one spans all 16 codes
    of its group (``lo <= 0 <= hi``); all 1-D of one length."""
    size = lo.shape[0]
    u32, out32, half_u32 = np.empty(size, np.uint32), np.zeros(size, np.uint32), np.empty(size, np.uint32)
    row, out, half_f32 = u32.view(np.float32), out32.view(np.float32), half_u32.view(np.float32)
    for factor in (INT4_DOWN, INT4_UP):  # UP last: it wins where both span all codes
        for i in range(size):
            row[i] = (hi[i] - lo[i]) / np.float32(15.0) * factor
        for i in range(size):
            u32[i] &= INT4_SCALE_MASK
        for i in range(size):
            c = np.floor(row[i] * np.float32(2.0**24)) * np.float32(2.0**-24)
            if _spans_all_codes(lo[i], hi[i], c):
                out[i] = c
    chosen = np.empty(size, np.uint16)
    _store(out, out32, False, half_f32, half_u32, chosen.reshape(1, 1, 1, 1, size), 0, 0, 0, 0)
    for i in range(size):
        if out[i] > 0:
            bits[i], values[i] = chosen[i], LUT_F16[chosen[i]]


@numba.njit(**_JIT)
def zero_points(lo, scale, zero, values):
    """``clamp(round(-lo / scale), 0, 15)`` per group (``lo <= 0``) into ``zero`` (uint8) and
    its float32 ``values``; all 1-D of one length."""
    for i in range(lo.shape[0]):
        z = min(max(np.rint(-lo[i] / scale[i]), np.float32(0.0)), np.float32(15.0))
        zero[i], values[i] = np.uint8(z), z


@numba.njit(**_JIT)
def group_amax(x, lut, gk, gv, k_amax, v_amax, h0, h1):
    """Absmax of K per (n, head, token group of ``gk``, channel) into ``k_amax`` and of V per
    (n, head, token, channel group of ``gv``) into ``v_amax``, as float32 (``lut``: the
    dtype's table)."""
    n_, _, heads, tokens, dim = x.shape
    acc = np.zeros(dim, np.uint16)
    for n in range(n_):
        for h in range(h0, h1):
            for t in range(tokens):
                for d in range(dim):
                    a = x[n, 0, h, t, d] & np.uint16(0x7FFF)
                    acc[d] = a if a > acc[d] else acc[d]
                if (t + 1) % gk == 0:
                    for d in range(dim):
                        k_amax[n, h, t // gk, d] = lut[acc[d]]
                        acc[d] = 0
                for g in range(dim // gv):
                    m = np.uint16(0)
                    for j in range(gv):  # from 0: range(g * gv, (g + 1) * gv) did not vectorise (5x slower)
                        d = g * gv + j
                        a = x[n, 1, h, t, d] & np.uint16(0x7FFF)
                        m = a if a > m else m
                    v_amax[n, h, t, g] = lut[m]


@numba.njit(**_JIT)
def int8_encode(x, bf16, gk, gv, k_scale, v_scale, out, h0, h1):
    """``clamp(round(x / scale), -127, 127)`` as int8, with K and V group scales (float32)."""
    n_, _, heads, tokens, dim = x.shape
    u32 = np.empty(dim, np.uint32)
    row = u32.view(np.float32)
    lo, hi = np.float32(-127.0), np.float32(127.0)
    for n in range(n_):
        for h in range(h0, h1):
            for t in range(tokens):
                _load(x, n, 0, h, t, bf16, u32, row)
                tg = t // gk
                for d in range(dim):
                    out[n, 0, h, t, d] = np.int8(min(max(np.rint(row[d] / k_scale[n, h, tg, d]), lo), hi))
                _load(x, n, 1, h, t, bf16, u32, row)
                for g in range(dim // gv):
                    s = v_scale[n, h, t, g]
                    for j in range(gv):  # from 0: range(g * gv, (g + 1) * gv) did not vectorise (5x slower)
                        d = g * gv + j
                        out[n, 1, h, t, d] = np.int8(min(max(np.rint(row[d] / s), lo), hi))


# ----- INT4 ------------------------------------------------------------------------------

@numba.njit(**_JIT)
def group_minmax(x, lut, gk, gv, k_lo, k_hi, v_lo, v_hi, h0, h1):
    """Min and max of K per (n, head, token group, channel) and of V per (n, head, token,
    channel group), as float32 (``lut``: the dtype's table)."""
    n_, _, heads, tokens, dim = x.shape
    lo, hi = np.empty(dim, np.int32), np.empty(dim, np.int32)
    for n in range(n_):
        for h in range(h0, h1):
            for t in range(tokens):
                if t % gk == 0:
                    lo[:] = 0x7FFF
                    hi[:] = -0x7FFF
                for d in range(dim):
                    key = _key(x[n, 0, h, t, d])
                    lo[d] = key if key < lo[d] else lo[d]
                    hi[d] = key if key > hi[d] else hi[d]
                if (t + 1) % gk == 0:
                    for d in range(dim):
                        k_lo[n, h, t // gk, d] = _unkey(lo[d], lut)
                        k_hi[n, h, t // gk, d] = _unkey(hi[d], lut)
                for g in range(dim // gv):
                    a, b = np.int32(0x7FFF), np.int32(-0x7FFF)
                    for j in range(gv):  # from 0: range(g * gv, (g + 1) * gv) did not vectorise (5x slower)
                        d = g * gv + j
                        key = _key(x[n, 1, h, t, d])
                        a = key if key < a else a
                        b = key if key > b else b
                    v_lo[n, h, t, g] = _unkey(a, lut)
                    v_hi[n, h, t, g] = _unkey(b, lut)


@numba.njit(**_JIT)
def int4_encode(x, bf16, gk, gv, k_scale, k_zero, v_scale, v_zero, out, h0, h1):
    """INT4 codes ``clamp(round(x / scale) + zero, 0, 15)``, two per byte (even channel in
    the low nibble), into ``out`` ``[n, 2, heads, tokens, dim // 2]``; needs an even ``dim``."""
    n_, _, heads, tokens, dim = x.shape
    u32, codes = np.empty(dim, np.uint32), np.empty(dim, np.uint8)
    row = u32.view(np.float32)
    zero_f, top = np.float32(0.0), np.float32(15.0)
    for n in range(n_):
        for h in range(h0, h1):
            for t in range(tokens):
                _load(x, n, 0, h, t, bf16, u32, row)
                tg = t // gk
                for d in range(dim):
                    codes[d] = np.uint8(min(max(np.rint(row[d] / k_scale[n, h, tg, d]) + k_zero[n, h, tg, d], zero_f), top))
                _pack(codes, out, n, 0, h, t)
                _load(x, n, 1, h, t, bf16, u32, row)
                for g in range(dim // gv):
                    s, z = v_scale[n, h, t, g], v_zero[n, h, t, g]
                    for j in range(gv):  # from 0: range(g * gv, (g + 1) * gv) did not vectorise (5x slower)
                        d = g * gv + j
                        codes[d] = np.uint8(min(max(np.rint(row[d] / s) + z, zero_f), top))
                _pack(codes, out, n, 1, h, t)


@numba.njit(inline="always", **_JIT)
def _pack(codes, out, n, c, h, t):
    """Two 4-bit codes a byte into the row ``out[n, c, h, t]``, the even one in the low nibble."""
    for p in range(codes.shape[0] // 2):
        out[n, c, h, t, p] = codes[2 * p] | (codes[2 * p + 1] << 4)


@numba.njit(**_JIT)
def int4_decode(packed, gk, gv, k_scale, k_zero, v_scale, v_zero, channels, fine, bf16, out, h0, h1):
    """``(code - zero) * scale``, clamped to the dtype's finite range, rounded into the fp16
    (bf16) bits ``out`` ``[n, 2, heads, tokens, dim]``; then each key channel
    ``channels[n, h, j]`` refined by its 4-bit residual (``fine``: the flat nibbles of
    ``codec_refine.int4_fine``), in ``Int4Codec._finish``'s float32 operations: the level
    read back from the rounded value, ``(level + (nibble - 8) / 16) * scale``, clamped, rounded."""
    n_, _, heads, tokens, dim = out.shape
    u32, half_u32, codes = np.empty(dim, np.uint32), np.empty(dim, np.uint32), np.empty(dim, np.float32)
    row, half_f32 = u32.view(np.float32), half_u32.view(np.float32)
    count = channels.shape[2]
    r32, rhalf32, refined = np.empty(count, np.uint32), np.empty(count, np.uint32), np.empty((1, 1, 1, 1, count), np.uint16)
    rrow, rhalf = r32.view(np.float32), rhalf32.view(np.float32)
    lut = LUT_BF16 if bf16 else LUT_F16
    limit = np.float32(3.3895313892515355e38) if bf16 else np.float32(65504.0)  # the dtype's largest finite
    for n in range(n_):
        for h in range(h0, h1):
            for t in range(tokens):
                _unpack(packed, n, 0, h, t, codes)
                tg = t // gk
                for d in range(dim):
                    row[d] = min(max((codes[d] - k_zero[n, h, tg, d]) * k_scale[n, h, tg, d], -limit), limit)
                _store(row, u32, bf16, half_f32, half_u32, out, n, 0, h, t)
                for j in range(count):
                    c, i = channels[n, h, j], ((n * heads + h) * tokens + t) * count + j
                    s = k_scale[n, h, tg, c]
                    nibble = (fine[i // 2] & np.uint8(15)) if i % 2 == 0 else (fine[i // 2] >> np.uint8(4))
                    level = np.rint(lut[out[n, 0, h, t, c]] / s)
                    rrow[j] = min(max((level + (np.float32(nibble) - np.float32(8.0)) / np.float32(16.0)) * s, -limit), limit)
                _store(rrow, r32, bf16, rhalf, rhalf32, refined, 0, 0, 0, 0)
                for j in range(count):
                    out[n, 0, h, t, channels[n, h, j]] = refined[0, 0, 0, 0, j]
                _unpack(packed, n, 1, h, t, codes)
                for g in range(dim // gv):
                    s, z = v_scale[n, h, t, g], v_zero[n, h, t, g]
                    for j in range(gv):  # from 0: range(g * gv, (g + 1) * gv) did not vectorise (5x slower)
                        d = g * gv + j
                        row[d] = min(max((codes[d] - z) * s, -limit), limit)
                _store(row, u32, bf16, half_f32, half_u32, out, n, 1, h, t)


@numba.njit(**_JIT)
def scatter_channels(out, channels, values):
    """The 16-bit patterns ``values[n, h, t, j]`` into the key channels ``channels[n, h, j]``
    of ``out`` ``[n, 2, heads, tokens, dim]`` (``gather_channels``' inverse)."""
    n_, _, heads, tokens, _ = out.shape
    for n in range(n_):
        for h in range(heads):
            for t in range(tokens):
                for j in range(channels.shape[2]):
                    out[n, 0, h, t, channels[n, h, j]] = values[n, h, t, j]


@numba.njit(inline="always", **_JIT)
def _unpack(packed, n, c, h, t, codes):
    """The two float32 codes of each byte of the row ``packed[n, c, h, t]``, low nibble first."""
    for p in range(codes.shape[0] // 2):
        byte = packed[n, c, h, t, p]
        codes[2 * p] = np.float32(byte & 15)
        codes[2 * p + 1] = np.float32(byte >> 4)


# ----- FP8 -------------------------------------------------------------------------------

@numba.njit(**_JIT)
def channel_amax(x, lut, k_out, v_out, h0, h1):
    """Absmax of K per (n, head, channel) over the tokens into ``k_out`` and of V per (n,
    head) into ``v_out``, as float32 (one pass: FP8's scales follow from both, K's without
    its exact channels, since a max is exact in any order)."""
    n_, _, heads, tokens, dim = x.shape
    acc, acc_v = np.zeros(dim, np.uint16), np.zeros(dim, np.uint16)
    for n in range(n_):
        for h in range(h0, h1):
            acc[:] = 0
            acc_v[:] = 0
            for t in range(tokens):
                for d in range(dim):
                    a = x[n, 0, h, t, d] & np.uint16(0x7FFF)
                    acc[d] = a if a > acc[d] else acc[d]
                    b = x[n, 1, h, t, d] & np.uint16(0x7FFF)
                    acc_v[d] = b if b > acc_v[d] else acc_v[d]
            for d in range(dim):
                k_out[n, h, d] = lut[acc[d]]
            v_out[n, h] = lut[acc_v.max()]


@numba.njit(inline="always", **_JIT)
def _e4m3(row, scale, keep, bound, n, h, masked, scaled, bits, out, c, t):
    """e4m3 codes of ``clamp(row / scale, -448, 448)`` into ``out[n, c, h, t]``; where
    ``masked``, further clamped to ``bound[n, h, d]``, and +0 where ``keep[n, h, d]`` is 0
    (round to nearest even, as torch converts); ``scaled`` is a float32 scratch row,
    ``bits`` its view."""
    dim = row.shape[0]
    for d in range(dim):
        value = min(max(row[d] / scale, np.float32(-448.0)), np.float32(448.0))
        if masked:
            b = bound[n, h, d]  # explicit: a value within the bound keeps its own sign of zero (as the reference)
            value = (b if value > b else (-b if value < -b else value)) if keep[n, h, d] != 0 else np.float32(0.0)
        scaled[d] = value
    for d in range(dim):
        u = bits[d] & np.uint32(0x7FFFFFFF)
        sign = np.uint8((bits[d] >> np.uint32(24)) & np.uint32(0x80))
        # normal: drop 20 mantissa bits rounding to even, rebias the exponent 127 -> 7
        normal = ((u + np.uint32(0x7FFFF) + ((u >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)) - np.uint32(120 << 3)
        # subnormal (below 2^-6): steps of 2^-9
        small = np.uint32(np.rint(abs(scaled[d]) * np.float32(512.0)))
        out[n, c, h, t, d] = sign | np.uint8(small if u < np.uint32(0x3C800000) else normal)


@numba.njit(**_JIT)
def fp8_encode(x, bf16, keep, scale, bound, out, h0, h1):
    """e4m3 codes of ``clamp(x / scale[n, half], -448, 448)`` into ``out`` (uint8 view);
    K's values further clamped to ``bound[n, h, d]`` (``codec_fp8.fp8_bounds``), its outlier
    channels (``keep`` 0) code 0."""
    n_, _, heads, tokens, dim = x.shape
    u32, scaled_u32 = np.empty(dim, np.uint32), np.empty(dim, np.uint32)
    row, scaled = u32.view(np.float32), scaled_u32.view(np.float32)
    for n in range(n_):
        for h in range(h0, h1):
            for t in range(tokens):
                _load(x, n, 0, h, t, bf16, u32, row)
                _e4m3(row, scale[n, 0], keep, bound, n, h, True, scaled, scaled_u32, out, 0, t)
                _load(x, n, 1, h, t, bf16, u32, row)
                _e4m3(row, scale[n, 1], keep, bound, n, h, False, scaled, scaled_u32, out, 1, t)


@numba.njit(**_JIT)
def gather_channels(x, channels, out):
    """The 16-bit patterns of the key channels ``channels[n, h, j]`` into ``out[n, h, t, j]``."""
    n_, _, heads, tokens, _ = x.shape
    for n in range(n_):
        for h in range(heads):
            for t in range(tokens):
                for j in range(channels.shape[2]):
                    out[n, h, t, j] = x[n, 0, h, t, channels[n, h, j]]


@numba.njit(**_JIT)
def fp8_decode(codes, lut, scale, bf16, out, h0, h1):
    """``e4m3(code) * scale[n, half]`` in float32, rounded once into the fp16 (bf16) bits
    ``out`` ``[n, 2, heads, tokens, dim]`` (``lut``: ``LUT_E4M3``), as the reference's one
    float32 product does; the exact key channels are written afterwards."""
    n_, _, heads, tokens, dim = out.shape
    u32, half_u32 = np.empty(dim, np.uint32), np.empty(dim, np.uint32)
    row, half_f32 = u32.view(np.float32), half_u32.view(np.float32)
    for n in range(n_):
        for c in range(2):
            s = scale[n, c]
            for h in range(h0, h1):
                for t in range(tokens):
                    for d in range(dim):
                        row[d] = lut[codes[n, c, h, t, d]] * s
                    _store(row, u32, bf16, half_f32, half_u32, out, n, c, h, t)
