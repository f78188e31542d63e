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


def cache_with_a_replaced_folder(tmp_path):
    """A ``TieredKVCache`` (prefilled, flushed, still open) whose NVMe folder was removed and
    made anew, then filled by a second cache that closed there (prompt ``500..540``
    of namespace ``ns``). Returns ``(first cache, folder, reopen)``: ``reopen()`` opens a cache
    on the folder like the two."""
    import shutil

    from tiercache import TieredKVCache

    layout = KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="float32", block_tokens=4)
    cache_tiers = [TierConfig("hbm", 2), TierConfig("dram", 3), TierConfig("nvme", 400)]
    path = tmp_path / "nvme"

    def reopen():
        return TieredKVCache(layout, cache_tiers, path=path, device="cpu")

    def prefill(cache, start):
        seq = cache.sequence(tokens=list(range(start, start + 41)), namespace="ns")
        for layer in range(2):
            seq.append(layer, torch.randn(2, 41, 16), torch.randn(2, 41, 16))

    first = reopen()
    prefill(first, 0)
    first.flush()
    shutil.rmtree(path)
    path.mkdir()
    with reopen() as second:
        prefill(second, 500)
    return first, path, reopen
