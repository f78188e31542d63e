"""The compiled codec loops (``tiercache.data.codec_kernels``) against the torch reference.

Every check is bit-exact, on fresh random blocks (unseeded) over hypothesis-chosen shapes,
for fp16 and bf16, plus exhaustive checks of the fp16/bf16 <-> float32 row conversions.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from tiercache.config import Codec  # noqa: E402
from tiercache.data import codec_kernels as kernels  # noqa: E402
from tiercache.data.codecs import codec_for  # noqa: E402

from test_codecs import synthetic_block  # noqa: E402

QUANTISED = (Codec.INT8, Codec.FP8, Codec.INT4)
HALF = (torch.float16, torch.bfloat16)
shapes = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 70), st.integers(1, 70))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_fast_equals_reference(codec: Codec, block: torch.Tensor) -> None:
    impl = codec_for(codec)
    fast, reference = impl.encode(block), impl.encode_reference(block)
    assert all(same_bits(a, b) for a, b in zip(fast.tensors, reference.tensors, strict=True))
    for dtype in (*HALF, torch.float32):
        out = torch.empty(block.shape, dtype=dtype)
        assert same_bits(impl.decode(reference, out.clone()), impl.decode_reference(reference, out.clone()))


@pytest.mark.parametrize("codec", QUANTISED)
@pytest.mark.parametrize("dtype", HALF)
@settings(max_examples=8, deadline=None)
@given(shape=shapes)
def test_fast_paths_equal_the_reference_bit_for_bit(codec, dtype, shape):
    assert_fast_equals_reference(codec, synthetic_block(*shape, dtype=dtype))


@pytest.mark.parametrize("codec", QUANTISED)
@pytest.mark.parametrize("dtype", HALF)
def test_fast_paths_equal_the_reference_on_extreme_values(codec, dtype):
    """Zeros, tiny (subnormal) values, values near the dtype's largest, and mixed signs."""
    block = synthetic_block(1, 2, 64, 64, dtype=torch.float32)
    block[0, 0, 0, :8] = 0
    block[0, 1, 1, 3:9] = torch.finfo(dtype).tiny * torch.randn(6, 64)
    block[0, 0, 1, 10] = 8000.0 if dtype == torch.float16 else 2e5  # INT8/INT4 scales are fp16: |x| < 65504 * 7
    assert_fast_equals_reference(codec, block.to(dtype))


def test_fp16_rows_load_exactly():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    values = bits.view(np.float16)
    finite = np.isfinite(values)
    u32 = np.empty(bits.size, np.uint32)
    kernels._load(bits.reshape(1, 1, 1, 1, -1), 0, 0, 0, 0, False, u32, u32.view(np.float32))
    assert np.array_equal(u32.view(np.float32)[finite], values[finite].astype(np.float32))


def test_bf16_rows_load_exactly():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    u32 = np.empty(bits.size, np.uint32)
    kernels._load(bits.reshape(1, 1, 1, 1, -1), 0, 0, 0, 0, True, u32, u32.view(np.float32))
    expected = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    finite = np.isfinite(expected)
    assert np.array_equal(u32.view(np.float32)[finite], expected[finite])


@pytest.mark.parametrize("dtype", HALF)
def test_float32_rows_round_as_torch_does(dtype):
    """Random magnitudes over every fp16 range (subnormal, normal, overflow), and exact ties."""
    exponents = torch.randint(-30, 20, (200_000,)).float()
    values = torch.randn(200_000) * torch.pow(2.0, exponents)
    ties = (torch.arange(-4096, 4096, dtype=torch.float32) + 0.5) * 2.0**-10  # halfway between fp16 values
    values = torch.cat((values, ties, torch.tensor([0.0, -0.0, 65504.0, 65520.0, 1e30, -1e30, float("inf"), float("-inf")])))
    f32 = values.numpy().copy()
    half_u32 = np.empty(f32.size, np.uint32)
    dest = np.empty(f32.size, np.uint16)
    kernels._store(f32, f32.view(np.uint32), dtype == torch.bfloat16, half_u32.view(np.float32), half_u32,
                   dest.reshape(1, 1, 1, 1, -1), 0, 0, 0, 0)
    assert np.array_equal(dest, values.to(dtype).view(torch.int16).numpy().view(np.uint16))
    nan = np.array([np.nan, -np.nan], dtype=np.float32)
    kernels._store(nan, nan.view(np.uint32), dtype == torch.bfloat16, half_u32[:2].view(np.float32), half_u32[:2],
                   dest[:2].reshape(1, 1, 1, 1, -1), 0, 0, 0, 0)
    assert torch.from_numpy(dest[:2].view(np.int16).copy()).view(dtype).isnan().all()


def test_e4m3_codes_round_as_torch_does():
    values = torch.cat((torch.randn(100_000) * torch.pow(2.0, torch.randint(-12, 9, (100_000,)).float()),
                        torch.linspace(-448, 448, 20_001), torch.tensor([0.0, -0.0, 2.0**-10, 2.0**-9 * 1.5])))
    values = values.clamp(-448, 448)
    scaled = np.empty(values.numel(), np.float32)
    codes = np.empty(values.numel(), np.uint8)
    keep = np.ones((1, 1, values.numel()), np.float32)
    kernels._e4m3(values.numpy(), np.float32(1.0), keep, keep, 0, 0, False, scaled, scaled.view(np.uint32), codes.reshape(1, 1, 1, 1, -1), 0, 0)
    assert np.array_equal(codes, values.to(torch.float8_e4m3fn).view(torch.uint8).numpy())


def test_float32_and_strided_blocks_take_the_reference_path():
    """No compiled loop for fp32 or non-contiguous blocks: the reference runs, same result."""
    impl = codec_for(Codec.INT8)
    block = synthetic_block(1, 2, 32, 16, dtype=torch.float32)
    assert all(same_bits(a, b) for a, b in zip(impl.encode(block).tensors, impl.encode_reference(block).tensors))
    strided = synthetic_block(1, 2, 32, 32)[..., ::2]
    assert all(same_bits(a, b) for a, b in zip(impl.encode(strided).tensors, impl.encode_reference(strided).tensors))


@pytest.mark.parametrize("codec", QUANTISED)
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_encode_into_writes_the_reference_bytes_at_any_buffer_offset(codec, offset):
    """``encode_into`` writes each part in place where the slot is aligned and falls back to a
    copy where it is not (odd offsets); either way the slot holds the reference's bytes and
    nothing outside it changes."""
    impl = codec_for(codec)
    block = synthetic_block(2, 3, 48, 64, dtype=torch.float16)
    expected = impl.to_bytes(impl.encode_reference(block))
    backing = torch.full((expected.numel() + 8,), 0xA5, dtype=torch.uint8)
    slot = backing[offset:offset + expected.numel()]
    impl.encode_into(block, slot)
    assert torch.equal(slot, expected)
    assert bool((backing[:offset] == 0xA5).all()) and bool((backing[offset + expected.numel():] == 0xA5).all())
    out = torch.empty_like(block)
    assert same_bits(impl.decode_from(slot, block.dtype, out), impl.decode_reference(impl.encode_reference(block), out.clone()))


@pytest.mark.parametrize("codec", QUANTISED)
@pytest.mark.parametrize("dtype", [*HALF, torch.float32])
@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_a_non_finite_block_is_refused_by_every_encode_path(codec, dtype, bad):
    """One inf would turn its whole group into NaN: every path refuses it by name."""
    from tiercache.errors import UserError

    impl = codec_for(codec)
    block = synthetic_block(1, 2, 64, 64, dtype=dtype)
    block[0, 1, 1, 17, 5] = bad
    buf = torch.empty(impl.nbytes_of(tuple(block.shape), block.dtype), dtype=torch.uint8)
    for encode in (impl.encode, impl.encode_reference, lambda b: impl.encode_into(b, buf)):
        with pytest.raises(UserError, match="inf or NaN"):
            encode(block)
