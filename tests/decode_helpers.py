"""A small CPU decode cache for the decode-cache probe tests: 2 layers, 2 KV heads of dim 8,
float32, 4-token blocks, tiers HBM 8 / DRAM 16 / NVMe 64 blocks."""

from __future__ import annotations

import torch

from tiercache import TieredKVCache
from tiercache.config import KVLayout, TierConfig

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float32", block_tokens=4)


def small_cache(path, **options) -> TieredKVCache:
    """A ``TieredKVCache`` of ``LAYOUT`` on the CPU under ``path`` (``options`` passed on)."""
    tiers = [TierConfig("hbm", 8), TierConfig("dram", 16), TierConfig("nvme", 64)]
    return TieredKVCache(LAYOUT, tiers, path=path, device="cpu", **options)


def random_kv(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V of one layer for ``tokens`` tokens: ``[kv_heads, tokens, head_dim]`` each."""
    return torch.randn(2, tokens, 8), torch.randn(2, tokens, 8)
