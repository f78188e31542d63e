"""Probe Q79 findings on quantised tiers (972 codec cases, 504 error bounds, 24 demote/promote
hierarchies, 42 decode and 15 generate configurations held):

- Q79-1: the codecs record the key channels they keep exact or refine as int16, and nothing
  bounded head_dim: from channel 32768 on FP8 lost a channel silently, INT8/INT4 failed with
  torch's raw index error. A quantised tier of heads wider than 32768 channels is now refused
  when it is built.
- Q79-3: a value just past a codec's range was printed with 6 digits, like the limit.
(Q79-2, a README figure for INT8 with FP8 round trips, is re-measured there; Q79-4, the
append's "token 3", now says "appended token 3".)
"""

from __future__ import annotations

import pytest
import torch

from tiercache import TieredKVStore
from tiercache.config import CODEC_MAX_HEAD_DIM, KVLayout, TierConfig
from tiercache.errors import ConfigError, UserError


def _layout(head_dim: int, dtype: str = "float16") -> KVLayout:
    return KVLayout(layers=1, kv_heads=1, head_dim=head_dim, dtype=dtype, block_tokens=4)


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
def test_a_quantised_tier_of_heads_wider_than_int16_channel_ids_is_refused(tmp_path, codec):
    with pytest.raises(ConfigError, match=f"codec {codec} cannot store head_dim {CODEC_MAX_HEAD_DIM + 1}"):
        TieredKVStore(_layout(CODEC_MAX_HEAD_DIM + 1), [TierConfig("hbm", 1), TierConfig("nvme", 4, codec=codec)],
                      path=tmp_path)


def test_the_widest_head_a_codec_takes_keeps_its_last_channel(tmp_path):
    layout = _layout(CODEC_MAX_HEAD_DIM)
    x = torch.randn(2, *layout.block_shape) * 0.1
    x[:, 0, 0, 0, :, -1] = 60  # the largest key channel, the last one: FP8 keeps it exact
    x = x.half()
    with TieredKVStore(layout, [TierConfig("hbm", 1), TierConfig("nvme", 4, codec="fp8")], path=tmp_path) as store:
        store.put([b"a" * 16, b"b" * 16], x)  # the first is demoted into the FP8 tier
        back = store.get([b"a" * 16])
    assert torch.equal(back[0, 0, 0, 0, :, -1], x[0, 0, 0, 0, :, -1])


def test_a_value_just_past_the_range_is_printed_apart_from_the_limit():
    layout = _layout(8, "float32")
    x = torch.zeros(1, *layout.block_shape)
    x[0, 0, 0, 0, 0, 0] = 458528.03125
    with TieredKVStore(layout, [TierConfig("hbm", 1), TierConfig("dram", 4, codec="int4")], device="cpu") as store:
        with pytest.raises(UserError, match=r"holds 458528\.031, beyond the \|x\| <= 458528 "):
            store.put([b"a" * 16], x)
