"""Small layouts, tiers, keys and blocks shared by the live-store tests."""

from __future__ import annotations

import torch

from tiercache.config import KVLayout, TierConfig

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)


def tiers(hbm: int = 2, dram: int = 3, nvme: int = 40) -> list[TierConfig]:
    """A three-tier hierarchy small enough that blocks spread over every tier."""
    return [TierConfig("hbm", hbm), TierConfig("dram", dram), TierConfig("nvme", nvme)]


def key(i: int) -> bytes:
    """A hand-made 16-byte key."""
    return i.to_bytes(16, "little")


def blocks(n: int, seed: int) -> torch.Tensor:
    """``n`` random fp16 blocks of ``LAYOUT`` (finite values: ``torch.equal`` compares them)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, *LAYOUT.block_shape), generator=gen).to(torch.float16)
