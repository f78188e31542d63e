"""Probe 2 findings on the codecs: INT8 (and INT4) fp16 scales no longer underflow on
small-magnitude KV (finding 3), and two error messages name what is wrong (finding 5: a
non-finite value for an FP8-only hierarchy, a capacity that is not an integer).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiercache import TieredKVStore  # noqa: E402
from tiercache.config import Codec, KVLayout, TierConfig  # noqa: E402
from tiercache.data import codec_kernels as kernels  # noqa: E402
from tiercache.data.codecs import _scale16, codec_for  # noqa: E402
from tiercache.errors import ConfigError, UserError  # noqa: E402

from store_helpers import key  # noqa: E402
from test_codec_kernels import assert_fast_equals_reference  # noqa: E402
from test_codecs import ROUND_TRIP_BOUND, rel_err, synthetic_block  # noqa: E402

SMALL_STDS = (1e-4, 3e-5, 1e-5, 1e-6, 1e-7, 1e-8)
STEP = 2.0 ** -24  # fp16's smallest positive value: the finest scale an fp16 scale can hold


def small_block(std: float, dtype: torch.dtype, outliers: bool = True) -> torch.Tensor:
    """A synthetic block (outlier key channels) or plain normal KV (the finding's repro),
    scaled to ``std`` per element, in ``dtype``."""
    x = synthetic_block(1, 2, 64, 128, dtype=torch.float32) if outliers else torch.randn(1, 2, 2, 64, 128)
    return (x * std).to(dtype)


def round_trip(codec: Codec, block: torch.Tensor, reference: bool = False) -> torch.Tensor:
    impl = codec_for(codec)
    if reference:
        return impl.decode_reference(impl.encode_reference(block), torch.empty_like(block))
    return impl.decode(impl.encode(block), torch.empty_like(block))


@pytest.mark.parametrize("std", SMALL_STDS)
@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("outliers", [False, True])
def test_int8_keeps_small_fp16_kv_within_its_bound(std, reference, outliers):
    """Was: fp16 scales ``absmax / 127`` rounded to 0 (then 1) below absmax 3.8e-6, so a block
    of std 1e-6 decoded to zeros (relative error 0.99), and rounded far down in fp16's
    subnormal range, clipping the largest values (0.021 at 1e-5)."""
    block = small_block(std, torch.float16, outliers)
    assert rel_err(round_trip(Codec.INT8, block, reference), block) <= ROUND_TRIP_BOUND[Codec.INT8]


@pytest.mark.parametrize("std", (1e-4, 1e-5, 1e-6))
def test_int4_keeps_small_fp16_kv_within_its_bound(std):
    block = small_block(std, torch.float16)
    assert rel_err(round_trip(Codec.INT4, block), block) <= ROUND_TRIP_BOUND[Codec.INT4]


@pytest.mark.parametrize("codec, top", [(Codec.INT8, 1), (Codec.INT8, 127), (Codec.INT4, 1), (Codec.INT4, 7)])
def test_fp16_kv_on_fp16s_finest_grid_round_trips_exactly(codec, top):
    """An fp16 group whose scale is 2^-24 holds every value exactly (each a multiple of 2^-24):
    INT8 absmax up to 127 * 2^-24, INT4 range up to 15 * 2^-24 (was: a group of a few
    multiples, ``top`` 1, decoded to zeros)."""
    block = (torch.randint(-top, top + 1, (1, 2, 2, 64, 128)) * STEP).half()
    assert torch.equal(round_trip(codec, block), block)
    assert torch.equal(round_trip(codec, block, reference=True), block)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("std", SMALL_STDS)
def test_int8_error_is_at_most_half_a_scale_at_any_magnitude(dtype, std):
    """|error| <= absmax / 254 (to fp16's rounding) + 2^-25 (half the finest fp16 scale),
    plus the output's own rounding; bf16/fp32 values far below 2^-24 meet it as zeros."""
    block = small_block(std, dtype)
    x = block.double()
    amax = float(x.abs().max())
    bound = amax / 254 * (1 + 2.0 ** -10) + STEP / 2 + amax * torch.finfo(dtype).eps
    assert float((round_trip(Codec.INT8, block).double() - x).abs().max()) <= bound


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.FP8, Codec.INT4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_all_zero_blocks_decode_to_zeros(codec, dtype):
    block = torch.zeros(1, 2, 2, 64, 128, dtype=dtype)
    assert torch.equal(round_trip(codec, block), block)


def test_normal_magnitude_scales_are_the_nearest_fp16_as_before():
    """Only scales below fp16's normal range changed: a unit-scale block's INT8 scales are
    still fp16(absmax / 127) bit for bit, so its ~0.6% error and its bytes are unchanged."""
    block = synthetic_block(2, 4, 256, 128)
    q = codec_for(Codec.INT8).encode(block)
    k_amax = block[:, 0].float().abs().amax(dim=-2, keepdim=True).unsqueeze(-3)  # one group of 256 tokens
    v_amax = block[:, 1].float().view(2, 4, 256, 2, 64).abs().amax(dim=-1, keepdim=True)
    assert torch.equal(q.scales[0], (k_amax / 127).half().view(q.scales[0].shape))
    assert torch.equal(q.scales[1], (v_amax / 127).half().view(q.scales[1].shape))
    assert rel_err(round_trip(Codec.INT8, block), block) <= 0.008
    assert q.nbytes == codec_for(Codec.INT8).nbytes_of(tuple(block.shape), block.dtype)


@pytest.mark.parametrize("qmax", [127, 15])
def test_compiled_scales_equal_the_reference_bit_for_bit(qmax):
    """``codec_kernels.half_scales`` against ``codecs._scale16`` over every fp16 magnitude:
    numerators just below, at and above each subnormal scale's bump point, and a log sweep."""
    subnormal = np.arange(0, 1025, dtype=np.float32) * np.float32(STEP)
    edges = np.concatenate([subnormal * np.float32(qmax + 0.5), subnormal * np.float32(qmax)])
    nums = np.concatenate([edges, np.nextafter(edges, np.float32(0)), np.nextafter(edges, np.float32(1)),
                           np.logspace(-40, 6, 4000, dtype=np.float64).astype(np.float32), [np.float32(0)]])
    nums = np.abs(nums).astype(np.float32)
    bits, values = np.empty(nums.shape, np.uint16), np.empty(nums.shape, np.float32)
    kernels.half_scales(nums, np.float32(qmax), bits, values)
    reference = _scale16(torch.from_numpy(nums), qmax)
    assert np.array_equal(bits, reference.view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(values, reference.float().numpy())
    positive = nums > 0
    assert (values[positive] > 0).all() and (nums[positive] / values[positive] <= qmax + 0.5).all()


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("std", (1e-3, 1e-4, 1e-5, 1e-6, 1e-7))
def test_fast_paths_equal_the_reference_on_small_magnitudes(codec, dtype, std):
    assert_fast_equals_reference(codec, small_block(std, dtype))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_an_int8_tier_keeps_small_kv_through_the_store(dtype):
    layout = KVLayout(layers=1, kv_heads=2, head_dim=64, dtype=dtype, block_tokens=64)
    blocks = (torch.stack([synthetic_block(1, 2, 64, 64, dtype=torch.float32) for _ in range(6)]) * 1e-6).to(getattr(torch, dtype))
    keys = [key(i) for i in range(6)]
    with TieredKVStore(layout, [TierConfig("hbm", 2), TierConfig("dram", 8, codec="int8")]) as store:
        assert store.put(keys, blocks) == 6
        assert store.lookup(keys)[1][0] == "dram"  # the first blocks were demoted: quantised
        back = store.get(keys[:2])
    bound = 0.0 if dtype == "float16" else 0.03  # fp16: exact; bf16/fp32: the 2^-25 floor, ~0.017 at std 1e-6
    assert rel_err(back, blocks[:2]) <= bound


def test_an_fp8_only_hierarchy_names_a_non_finite_value_not_a_limit_of_inf():
    layout = KVLayout(layers=1, kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
    blocks = torch.randn(3, *layout.block_shape).half()
    blocks[1, 0, 1, 0, 3, 5] = float("inf")
    with TieredKVStore(layout, [TierConfig("hbm", 2), TierConfig("dram", 4, codec="fp8")]) as store:
        with pytest.raises(UserError, match=r"block 1 holds inf \(at \[0, 1, 0, 3, 5\] within it") as caught:
            store.put([key(i) for i in range(3)], blocks)
    assert "<= inf" not in str(caught.value)


@pytest.mark.parametrize("capacity", [1.5, 2.0, "4", None])
def test_a_tier_capacity_that_is_not_an_integer_says_so(capacity):
    with pytest.raises(ConfigError, match="tier hbm: capacity must be an integer number of blocks"):
        TierConfig("hbm", capacity)


@pytest.mark.parametrize("capacity", [0, -3])
def test_a_tier_capacity_below_one_block_says_so(capacity):
    with pytest.raises(ConfigError, match=f"tier hbm: capacity must be at least one block, got {capacity}"):
        TierConfig("hbm", capacity)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4])
def test_a_block_spanning_float32s_range_is_refused_without_an_overflow_warning(codec):
    """Probe Q52 nit: INT4's group range ``max - min`` of a bf16 block holding about
    +-3.3e38 overflowed float32 with a numpy RuntimeWarning before the refusal (an error,
    not UnencodableError, where warnings are errors); the message states a bound every
    block under it meets."""
    from tiercache.data.codec_base import UnencodableError

    block = torch.full((2, 2, 16, 64), 3.3e38, dtype=torch.bfloat16)
    block[0, 0, 0, 0] = -3.3e38
    for encode in (codec_for(codec).encode, codec_for(codec).encode_reference):
        with pytest.raises(UnencodableError, match=r"INT8 takes every block of \|x\| < 8319008"):
            encode(block)
    under = torch.full((2, 2, 16, 64), 8319007.0 if codec is Codec.INT8 else 458527.0)
    under[0, 0, 0, 0] *= -1
    out = torch.empty_like(under)
    codec_for(codec).decode(codec_for(codec).encode(under), out)
    assert rel_err(out, under) <= ROUND_TRIP_BOUND[codec]
