"""Probe Q70 (codecs on edge inputs: zeros, constants, subnormals, dtype extremes, NaN and
infinities, 8,400 random blocks fast path against reference, byte for byte: no mismatch):
FP8 decoded a bf16 block's values past fp16's range into infinities in an fp16 ``out``,
where INT8 and INT4 clamp them to 65504."""

from __future__ import annotations

import pytest
import torch

from tiercache.data.codecs import codec_for


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
def test_decoding_into_fp16_clamps_what_fp16_cannot_hold(codec):
    torch.manual_seed(0)
    block = (torch.randn(2, 2, 16, 64) * 3e4).to(torch.bfloat16)  # |x| up to ~1.3e5
    assert (block.float().abs() > 65504).sum() > 100
    impl = codec_for(codec)
    q = impl.encode(block)
    wide = impl.decode(q, torch.empty(block.shape, dtype=torch.float32))
    for decode in (impl.decode, impl.decode_reference):
        out = decode(q, torch.empty(block.shape, dtype=torch.float16))
        assert torch.isfinite(out).all(), decode.__name__
        if codec != "int4":  # clamped; nothing else moves by more than fp16's rounding of the wide decode
            assert torch.allclose(out.float(), wide.clamp(-65504, 65504), rtol=2**-10, atol=0), decode.__name__
        # (INT4 decodes into fp16 with its group parameters in fp16: within its step of the wide decode)
    buf = torch.empty(impl.nbytes_of(tuple(block.shape), block.dtype), dtype=torch.uint8)
    impl.encode_into(block, buf)
    assert torch.isfinite(impl.decode_from(buf, block.dtype, torch.empty(block.shape, dtype=torch.float16))).all()


def test_fp8_decoding_within_fp16s_range_is_untouched():
    torch.manual_seed(1)
    block = torch.randn(2, 2, 16, 64).half()
    impl = codec_for("fp8")
    q = impl.encode(block)
    out = impl.decode(q, torch.empty_like(block))
    assert torch.equal(out, impl.decode(q, torch.empty(block.shape)).half())
