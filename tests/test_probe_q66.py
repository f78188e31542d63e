"""Probe Q66 finding: a decode gave no way to make its NVMe blocks durable but closing (or the
store underneath), so a decode killed mid-run reopened with none of its prompts, though their
blocks had long been written to NVMe. ``TieredKVCache.flush`` makes them durable."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent('''
    import os, signal, sys, torch
    from tiercache import TieredKVCache
    from tiercache.config import KVLayout, TierConfig
    layout = KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="float32", block_tokens=4)
    tiers = [TierConfig("hbm", 2), TierConfig("dram", 3), TierConfig("nvme", 400)]
    cache = TieredKVCache(layout, tiers, path=sys.argv[1], device="cpu")
    torch.manual_seed(0)
    for p in range(3):  # three prompts: most of their blocks spill to NVMe
        seq = cache.sequence(tokens=list(range(100 * p, 100 * p + 41)), namespace="ns")
        for layer in range(2):
            seq.append(layer, torch.randn(2, 41, 16), torch.randn(2, 41, 16))
    if sys.argv[2] == "flush":
        cache.flush()
    for layer in range(2):  # a decode step after the flush, then the crash
        seq.append(layer, torch.randn(2, 1, 16), torch.randn(2, 1, 16))
    os.kill(os.getpid(), signal.SIGKILL)
''')


@pytest.mark.parametrize("flushed", [True, False])
def test_a_flushed_decode_killed_later_reopens_with_its_prompts(tmp_path, flushed):
    from tiercache import TieredKVCache
    from tiercache.config import KVLayout, TierConfig

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    path = tmp_path / "nvme"
    done = subprocess.run([sys.executable, str(script), str(path), "flush" if flushed else "no"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    layout = KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="float32", block_tokens=4)
    tiers = [TierConfig("hbm", 2), TierConfig("dram", 3), TierConfig("nvme", 400)]
    with TieredKVCache(layout, tiers, path=path, device="cpu") as cache:
        found = [cache.match_prefix(list(range(100 * p, 100 * p + 41)), namespace="ns") for p in range(3)]
        cache.check_invariants()
    if flushed:
        assert found[:2] == [40, 40] and found[2] > 0, found  # the blocks that had spilled to NVMe by the flush
    else:
        assert found == [0, 0, 0]  # nothing was made durable: the index is written at a flush


def test_a_tier_without_a_codec_may_say_so_with_none():
    """Probe Q66: ``codec=None`` (a list of tiers where some have no codec) was refused."""
    from tiercache.config import Codec, ConfigError, TierConfig

    assert TierConfig("dram", 4, codec=None) == TierConfig("dram", 4, codec="none") == TierConfig("dram", 4)
    assert TierConfig("dram", 4, codec=None).codec is Codec.NONE
    with pytest.raises(ConfigError, match="codec must be a Codec or its name, got 8"):
        TierConfig("dram", 4, codec=8)
