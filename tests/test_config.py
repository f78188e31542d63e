"""``tiercache.config`` parsers: ``--tiers`` and ``--layout`` validation."""

from __future__ import annotations

import pytest

from tiercache.config import ConfigError, TierConfig, layout_preset, parse_layout, parse_tiers


def test_parse_tiers_accepts_an_ordered_hierarchy():
    tiers = parse_tiers("hbm=10,dram=4k,nvme=2GiB", layout_preset("llama-3-8b", 512))
    assert [(t.name, t.capacity_blocks) for t in tiers] == [("hbm", 10), ("dram", 4000), ("nvme", 32)]


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("hbm=10,hbm=5", "repeat"),
        ("dram=5,hbm=10", "fastest first"),
        ("hbm=10,nvme=5,dram=7", "fastest first"),
    ],
)
def test_parse_tiers_rejects_repeats_and_wrong_order(spec, needle):
    with pytest.raises(ConfigError) as info:
        parse_tiers(spec, None)
    message = str(info.value)
    assert message.startswith("--tiers") and needle in message and "CacheConfig" not in message


def test_parse_layout_custom_spec_and_block_override():
    layout = parse_layout("layers=32,kv_heads=8,head_dim=128,dtype=bfloat16", 512)
    assert layout.block_tokens == 512 and layout.block_bytes == layout_preset("llama-3-8b", 512).block_bytes
    assert parse_layout("layers=2,kv_heads=1,head_dim=8,block_tokens=16").block_tokens == 16


@pytest.mark.parametrize("spec", ["layers=32,kv_heads=8", "layers=32,kv_heads=8,head_dim=x", "layers=1,kv_heads=1,head_dim=1,depth=3"])
def test_parse_layout_errors_name_the_option(spec):
    with pytest.raises(ConfigError, match="--layout"):
        parse_layout(spec)


def test_remote_config_is_validated_and_only_the_remote_tier_takes_one():
    from tiercache.config import RemoteConfig, RemoteWrite

    good = RemoteConfig("127.0.0.1:5000", "http://127.0.0.1:5001/metadata")
    assert good.write is RemoteWrite.THROUGH  # the documented default
    assert TierConfig("remote", 8, remote=good).remote is good
    for bad in ({"master": "nohost"}, {"metadata": "127.0.0.1:5001"}, {"write": "through"}, {"timeout_s": 0},
                {"segment_bytes": -1}, {"write_hits": 0}, {"timeout_s": float("inf")}, {"timeout_s": float("nan")},
                {"retry_s": float("nan")}, {"staging_blocks": 2.5}, {"write_hits": 2.5}):
        fields = {"master": "127.0.0.1:5000", "metadata": "http://127.0.0.1:5001/metadata", **bad}
        with pytest.raises(ConfigError, match="RemoteConfig"):
            RemoteConfig(**fields)
    with pytest.raises(ConfigError, match="remote=RemoteConfig"):
        TierConfig("remote", 8)
    with pytest.raises(ConfigError, match="remote=RemoteConfig"):
        TierConfig("dram", 8, remote=good)
    with pytest.raises(ConfigError, match="remote must be a RemoteConfig, got dict"):
        TierConfig("remote", 8, remote={"master": "127.0.0.1:5000"})
    with pytest.raises(ConfigError, match="codec int8 is not supported there"):
        TierConfig("remote", 8, remote=good, codec="int8")
