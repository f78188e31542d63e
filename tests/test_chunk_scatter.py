"""A chunk whose blocks interleave across tiers is copied with indexed copies (a bounded number
per piece), and gives the same bits as run-by-run copies."""

from __future__ import annotations

import pytest
import torch

from tiercache import AttentionMode, TieredKVCache
from tiercache.config import KVLayout, TierConfig
from tiercache.live import chunks

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)


def _decode(path, seed: int = 1) -> list[torch.Tensor]:
    """Exact and sparse outputs of a two-layer decode whose blocks spread over three tiers."""
    gen = torch.Generator().manual_seed(seed)
    tiers = [TierConfig("hbm", 2), TierConfig("dram", 3), TierConfig("nvme", 256)]
    outs = []
    with TieredKVCache(LAYOUT, tiers, path=path, device="cpu", window_blocks=8, prefetch="none") as cache:
        seq = cache.sequence()
        for layer in range(2):
            seq.append(layer, torch.randn(2, 90, 16, generator=gen).half(), torch.randn(2, 90, 16, generator=gen).half())
        for _ in range(4):
            for layer in range(2):
                seq.append(layer, torch.randn(2, 1, 16, generator=gen).half(), torch.randn(2, 1, 16, generator=gen).half())
                q = torch.randn(8, 1, 16, generator=gen).half()
                outs.append(seq.attend(layer, q))
                outs.append(seq.attend(layer, q, AttentionMode.SPARSE, budget=0.4))
    return outs


def test_scattered_and_run_copies_give_the_same_bits(tmp_path, monkeypatch):
    monkeypatch.setattr(chunks, "MAX_RUN_COPIES", 10**9)
    by_runs = _decode(tmp_path / "runs")
    calls = []
    real = chunks._scatter_blocks
    monkeypatch.setattr(chunks, "MAX_RUN_COPIES", 0)
    monkeypatch.setattr(chunks, "_scatter_blocks", lambda *a: (calls.append(1), real(*a)))
    scattered = _decode(tmp_path / "scattered")
    assert calls, "the scattered path never ran"
    assert all(torch.equal(a, b) for a, b in zip(by_runs, scattered, strict=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_scatter_blocks_matches_a_copy_per_block(dtype):
    gen = torch.Generator().manual_seed(7)
    blocks = torch.randn(5, 1, 2, 3, 4, 8, generator=gen).to(dtype)
    offsets = [0, 2, 3, 6, 9]
    expect_k, expect_v = torch.zeros(3, 10, 4, 8), torch.zeros(3, 10, 4, 8)
    for row, offset in enumerate(offsets):
        chunks._copy_blocks(blocks[row : row + 1], expect_k, expect_v, offset)
    k, v = torch.zeros(3, 10, 4, 8), torch.zeros(3, 10, 4, 8)
    chunks._scatter_blocks(blocks, k, v, offsets)
    assert torch.equal(k, expect_k) and torch.equal(v, expect_v)


def test_rows_of_gathers_only_when_the_rows_are_not_the_whole_tensor():
    blocks = torch.arange(24.0).view(6, 4)
    assert chunks._rows_of(blocks, range(6)) is blocks
    assert torch.equal(chunks._rows_of(blocks, [4, 1, 5]), blocks[[4, 1, 5]])
