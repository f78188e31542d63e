"""Probe X, findings 1-3: quantised blocks cycled through encode and decode settle.

1. INT4: a refined key channel's group scale walked on every re-encode (its range was taken
   over refined values, off the 16-code grid), for ~40 cycles, then alternated; the error
   against the original grew x1.39 (bf16). 2. INT8: the refined channel set changed at
   re-encodes 2-4 (channels picked by the decoded block's absmax). 3. FP8: the torch
   reference encoded +0 keys as -0 (0x80) where a head's bound was 0, the compiled loop 0x00.
"""

from __future__ import annotations

import pytest
import torch

from tiercache.data import codec_refine as refine
from tiercache.data.codecs import _asym_from, _k_groups, codec_for

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CYCLES = 6


def _outlier_block(seed: int, shape=(1, 2, 2, 256, 64)) -> torch.Tensor:
    """The probe's synthetic KV: gaussian, 4 key channels per head scaled x10-x50."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    for h in range(shape[2]):
        channels = torch.randperm(shape[-1], generator=gen)[:4]
        x[:, 0, h, :, channels] *= 10 + 40 * torch.rand(4, generator=gen)
    return x


def _uniform_block(seed: int, positive: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand((2, 2, 4, 64, 128), generator=gen)
    return x if positive else x * 2 - 1


def _paths(codec, dtype):
    """(name, encode, decode) of the paths that take ``dtype`` (fp32 has no compiled encode)."""
    yield "reference", codec.encode_reference, codec.decode_reference
    if dtype != torch.float32:
        yield "compiled", codec.encode, codec.decode


def _cycle(codec, block: torch.Tensor, encode, decode) -> tuple[list[torch.Tensor], list[float]]:
    """The bytes of each encoding over ``CYCLES`` round trips, and each decoding's relative
    error against ``block``."""
    encoded, errors, current = [], [], block
    for _ in range(CYCLES):
        q = encode(current)
        encoded.append(codec.to_bytes(q))
        current = decode(q, torch.empty_like(block))
        errors.append(float((current.double() - block.double()).norm() / block.double().norm()))
    return encoded, errors


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [4, 5])
def test_int4_reencodes_a_decoded_block_to_the_same_bytes(dtype, seed):
    """The probe's block (seed 4, bf16) drifted for 40 cycles; now every re-encode gives the
    first encoding's bytes, so the error against the original never grows."""
    codec = codec_for("int4")
    block = _outlier_block(seed).to(dtype)
    for _, encode, decode in _paths(codec, dtype):
        encoded, errors = _cycle(codec, block, encode, decode)
        assert all(torch.equal(encoded[0], later) for later in encoded[1:])
        assert max(errors) == errors[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("positive", [False, True])
def test_int8_settles_by_the_first_reencode(dtype, positive):
    """Uniform KV: channels of close absmax, where a decoded unrefined channel overtook a
    refined one at re-encodes 2-4 (README: 'stable after the first re-encode')."""
    codec = codec_for("int8")
    block = _uniform_block(2, positive).to(dtype)
    for _, encode, decode in _paths(codec, dtype):
        encoded, errors = _cycle(codec, block, encode, decode)
        assert all(torch.equal(encoded[1], later) for later in encoded[2:])
        assert max(errors) <= errors[0] * 1.0001


@pytest.mark.parametrize("codec_name", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_encode_equals_the_reference_on_original_and_decoded_blocks(codec_name, dtype):
    codec = codec_for(codec_name)
    for block in (_outlier_block(4).to(dtype), _uniform_block(2, True).to(dtype)):
        decoded = codec.decode(codec.encode(block), torch.empty_like(block))
        for x in (block, decoded):
            assert torch.equal(codec.to_bytes(codec.encode(x)), codec.to_bytes(codec.encode_reference(x)))


def test_int4_pins_only_groups_whose_refined_extremes_would_not_map_back():
    """The test blocks above take every branch of ``int4_pins``: groups kept as refined,
    pinned at moved refined extremes, and a pinned group decodes to its own scale again."""
    block = _outlier_block(4).to(torch.bfloat16)
    k = _k_groups(block.select(-4, 0))
    lo, hi = k.amin(dim=-2, keepdim=True).float(), k.amax(dim=-2, keepdim=True).float()
    scale, zero = _asym_from(lo, hi)
    lo_p, _, bottom, _ = refine.int4_pins(lo, hi, scale, zero, torch.bfloat16, 16.0)
    kept = lo_p.isnan()
    assert kept.any() and not kept.all()  # both kinds of group occur
    assert torch.isinf(bottom[kept]).all() and torch.isfinite(bottom[~kept]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hot", [False, True])
def test_fp8_keeps_positive_zero_keys_on_both_paths(dtype, hot):
    """A head whose exact channels' absmax is 0 (bound 0): +0 keys stay +0 (code 0x00),
    compiled and reference alike."""
    codec = codec_for("fp8")
    block = torch.zeros(1, 2, 1, 8, 16, dtype=dtype)
    if hot:
        block[0, 1, 0, 3, 2] = 1.0  # V only: K stays all zero
    fast, ref = codec.encode(block), codec.encode_reference(block)
    assert torch.equal(codec.to_bytes(fast), codec.to_bytes(ref))
    assert (ref.payload.view(torch.uint8).select(-4, 0) == 0).all()  # K: +0, not -0 (0x80)
    decoded = codec.decode_reference(ref, torch.empty_like(block))
    assert not torch.signbit(decoded).any()
