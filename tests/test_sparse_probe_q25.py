"""Probe Q25: sparse block selection over a GQA group, the blocks a sparse step always reads,
and ``speculate=0``."""

from __future__ import annotations

import json
import math

import torch

from tiercache import AttentionMode, TieredKVCache
from tiercache.config import KVLayout, TierConfig

from decode_helpers import random_kv, small_cache


def _cache(path, head_dim: int, block_tokens: int, blocks: int) -> TieredKVCache:
    """One layer, one KV head, float32 on the CPU, every block in HBM."""
    layout = KVLayout(layers=1, kv_heads=1, head_dim=head_dim, dtype="float32", block_tokens=block_tokens)
    tiers = [TierConfig("hbm", blocks + 4), TierConfig("dram", 8), TierConfig("nvme", 16)]
    return TieredKVCache(layout, tiers, eviction="lru", prefetch="none", path=path, device="cpu")


def _records(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f][1:]  # the header first


def test_a_diffuse_query_head_does_not_take_the_selection_from_the_focused_heads_of_its_group(tmp_path):
    # 64 blocks, 12 'topic' blocks along u; three query heads aim at u, a fourth has 0.05x the norm (diffuse)
    g = torch.Generator().manual_seed(0)
    block_tokens, head_dim, blocks = 16, 64, 64
    u = torch.randn(head_dim, generator=g)
    u /= u.norm()
    k = torch.randn(1, blocks * block_tokens, head_dim, generator=g)
    v = torch.randn(1, blocks * block_tokens, head_dim, generator=g)
    topic = (torch.randperm(blocks - 2, generator=g)[:12] + 1).tolist()
    for rank, b in enumerate(topic):
        k[0, b * block_tokens : (b + 1) * block_tokens] += (3.0 + 0.75 * rank) * u
    focused = (u * math.sqrt(head_dim) + 0.3 * torch.randn(3, head_dim, generator=g)).reshape(3, 1, head_dim)
    q = torch.cat([focused, 0.05 * torch.randn(1, 1, head_dim, generator=g)])
    with _cache(tmp_path, head_dim, block_tokens, blocks) as cache:
        seq = cache.sequence()
        seq.append(0, k, v)
        exact = seq.attend(0, q)[:3]
        sparse = seq.attend(0, q, AttentionMode.SPARSE, budget=14)[:3]
    # max-normalised bounds, max over heads: 2 of 12 topic blocks, error 0.36; shares averaged: 1e-3
    assert ((sparse - exact).norm() / exact.norm()).item() < 1e-2


def test_a_sparse_step_reads_the_sink_and_the_newest_block_whatever_the_budget(tmp_path):
    torch.manual_seed(0)
    with small_cache(tmp_path / "a", prefetch="layer_ahead", record=tmp_path / "steps.jsonl") as cache:
        seq = cache.sequence()
        for layer in range(2):
            seq.append(layer, *random_kv(4 * 40))  # 40 blocks of 4 tokens
        q = torch.randn(4, 1, 8)
        for budget in (1, 0.02):  # 0.02 of 40 blocks rounds up to one
            seq.attend(0, q, AttentionMode.SPARSE, budget=budget)
            assert seq.last_positions.tolist() == [0, 39] and seq.reports[-1].selected == 2
        seq.attend(1, q, AttentionMode.SPARSE, budget=1)
        assert seq.last_positions.tolist() == [0, 39]
    reads = [r for r in _records(tmp_path / "steps.jsonl") if r.get("read")]
    ahead = set(reads[-2].get("ahead", ()))  # layer 0's last read prefetched for layer 1 ...
    assert ahead and ahead <= set(reads[-1]["read"])  # ... only blocks layer 1's read used
    with small_cache(tmp_path / "b", sink_blocks=2, recent_blocks=2) as cache:
        seq = cache.sequence()
        seq.append(0, *random_kv(4 * 40))
        seq.attend(0, q, AttentionMode.SPARSE, budget=3)
        assert seq.last_positions.tolist() == [0, 1, 38, 39] and seq.reports[-1].selected == 4


def test_speculate_zero_makes_no_speculative_candidates_and_prefetches_none_of_them(tmp_path):
    torch.manual_seed(0)
    with small_cache(tmp_path, prefetch="topk_speculative", speculate=0, record=tmp_path / "steps.jsonl") as cache:
        seq = cache.sequence()
        seq.append(0, *random_kv(4 * 40))
        for _ in range(5):
            seq.attend(0, torch.randn(4, 1, 8), AttentionMode.SPARSE, budget=4)
        assert [r.prefetched for r in seq.reports] == [0] * 5
    assert not any(r.get("candidates") for r in _records(tmp_path / "steps.jsonl"))
