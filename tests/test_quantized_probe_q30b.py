"""Probe q30, findings 3 and 4 (quantised tiers in the live store).

Finding 3: ``get_slots`` handed out HBM slot numbers for a quantised HBM tier, whose slots hold
encoded bytes (``hbm_tensor`` refused it); it now refuses too, before moving or counting anything.

Finding 4: ``put`` and ``Sequence.append`` refused bf16/fp32 values beyond INT4's bound
(65504 * 7) in a hierarchy whose only quantised tier is INT8, whose fp16 scales (absmax / 127)
take values up to about 65504 * 127, and which took such a block on demotion: the bound is now the
lowest of the hierarchy's codecs' (``live.media.value_limit``), INT8's 253 * 2**15.
"""

from __future__ import annotations

import pytest
import torch

from store_helpers import key
from test_codecs import ROUND_TRIP_BOUND, rel_err
from tiercache import TieredKVStore
from tiercache.config import Codec, KVLayout, TierConfig
from tiercache.data.codec_base import INT8_LIMIT, SCALED_LIMIT
from tiercache.errors import UserError

BF16 = KVLayout(layers=1, kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=64)


def _blocks(n: int, big: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    blocks = torch.randn(n, *BF16.block_shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    blocks[:, 0, 1, 1, 7, 5] = big  # one value per block, in the values (any group would do)
    return blocks


@pytest.mark.parametrize("big", [999_424.0, INT8_LIMIT, -INT8_LIMIT])
def test_an_int8_only_hierarchy_takes_values_its_scales_hold(big):
    blocks, keys = _blocks(4, big), [key(i) for i in range(4)]
    with TieredKVStore(BF16, [TierConfig("hbm", 1), TierConfig("dram", 8, codec="int8")]) as store:
        assert store.put(keys, blocks) == 4  # three of them demoted into INT8 DRAM at once
        assert store.lookup(keys)[1].count("dram") == 3
        for k, block in zip(keys, blocks):
            got = store.get([k])[0]
            assert torch.isfinite(got.float()).all()
            assert rel_err(got, block) <= ROUND_TRIP_BOUND[Codec.INT8]


def test_values_past_int8s_bound_are_refused_at_put_in_the_blocks_dtype():
    past = torch.tensor(INT8_LIMIT).bfloat16().float().item()
    next_up = torch.nextafter(torch.tensor(INT8_LIMIT, dtype=torch.bfloat16).float(), torch.tensor(1e9)).item()
    assert past == INT8_LIMIT  # the bound is exact in bf16
    with TieredKVStore(BF16, [TierConfig("hbm", 1), TierConfig("dram", 8, codec="int8")]) as store:
        for value in (torch.tensor(INT8_LIMIT * 1.004).bfloat16().float().item(), 9e6, float(2**24)):
            with pytest.raises(UserError, match=r"block 0 holds [0-9.e+]+, beyond the \|x\| <= [0-9.e+]+ its codecs. scales reach \(at \["):
                store.put([key(9)], _blocks(1, value))
        assert store.lookup([key(9)])[0] == 0
    assert next_up > INT8_LIMIT


def test_a_hierarchy_with_int4_keeps_int4s_bound():
    with TieredKVStore(BF16, [TierConfig("hbm", 1), TierConfig("dram", 4, codec="int4")]) as store:
        with pytest.raises(UserError, match=f"beyond the \\|x\\| <= {SCALED_LIMIT:g} its codecs. scales reach"):
            store.put([key(1)], _blocks(1, 999_424.0))
    with TieredKVStore(BF16, [TierConfig("hbm", 1), TierConfig("dram", 4, codec="int8")]) as store:
        assert store.value_limit == INT8_LIMIT


def test_get_slots_refuses_a_quantised_hbm_tier_before_moving_or_counting():
    blocks, keys = _blocks(6, 1.0), [key(i) for i in range(6)]
    with TieredKVStore(BF16, [TierConfig("hbm", 4, codec="int8"), TierConfig("dram", 8)]) as store:
        store.put(keys, blocks)
        before, where = store.stats(), store.lookup(keys)[1]
        with pytest.raises(UserError, match="get_slots: the HBM tier is quantised \\(int8\\)"):
            store.get_slots(keys[:2])
        with pytest.raises(UserError, match="quantised"):
            store.hbm_tensor
        assert store.lookup(keys)[1] == where
        after = store.stats()
        assert [t["hits"] for t in after["tiers"]] == [t["hits"] for t in before["tiers"]]
        assert after["lookups"]["hits"] == before["lookups"]["hits"] + 12  # only the two lookups counted
