"""Attention math: partials merged by log-sum-exp equal dense float64 attention; the Quest
bound bounds; selection keeps sink and recent blocks and respects the budget."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.attention import (Partial, block_bounds, block_scores, block_summaries, dense_reference, merge,
                                 partial_attention, select_blocks, stream_attention)


class _ListSource:
    """A ChunkSource over chunks already in memory (records the schedule it was driven by)."""

    def __init__(self, chunks):
        self.chunks = chunks
        self.events = []

    def start(self, index, buffer):
        self.events.append(("start", index, buffer))
        return index

    def finish(self, handle):
        self.events.append(("finish", handle))
        return self.chunks[handle]


def _split(k, v, cuts):
    bounds = [0, *cuts, k.shape[1]]
    return [(k[:, a:b], v[:, a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]


@settings(max_examples=60, deadline=None)
@given(kv_heads=st.integers(1, 3), group=st.integers(1, 4), head_dim=st.sampled_from([4, 8, 16]),
       n=st.integers(1, 200), pieces=st.integers(1, 6), depth=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_streamed_partials_equal_dense_float64(kv_heads, group, head_dim, n, pieces, depth, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(kv_heads * group, 1, head_dim, generator=g) * 2
    k = torch.randn(kv_heads, n, head_dim, generator=g)
    v = torch.randn(kv_heads, n, head_dim, generator=g)
    cuts = sorted(torch.randint(1, max(2, n), (pieces - 1,), generator=g).tolist()) if n > 1 else []
    chunks = _split(k, v, cuts)
    tail, body = chunks[-1:], chunks[:-1]
    source = _ListSource(body)
    out = stream_attention(q, kv_heads, source, len(body), depth=depth, extra=tail)
    ref = dense_reference(q, k, v)
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 1e-5


def test_schedule_fetches_ahead_and_reuses_a_buffer_only_after_its_chunk_computed():
    k = torch.randn(1, 10, 4)
    source = _ListSource(_split(k, k, [2, 4, 6, 8]))
    stream_attention(torch.randn(1, 1, 4), 1, source, 5, depth=2)
    ev = source.events
    assert ev[:2] == [("start", 0, 0), ("start", 1, 1)]  # chunk 1 fetches while chunk 0 computes
    for index in range(2, 5):
        assert ev.index(("start", index, index % 2)) > ev.index(("finish", index - 2))


def test_merge_with_an_empty_partial_is_the_identity():
    q = torch.randn(2, 3, 8)
    full = partial_attention(q, torch.randn(2, 5, 8), torch.randn(2, 5, 8))
    empty = partial_attention(q, torch.zeros(2, 0, 8), torch.zeros(2, 0, 8))
    merged = merge(empty, full)
    assert torch.allclose(merged.out, full.out) and torch.allclose(merged.lse, full.lse)


def test_lse_is_the_log_sum_exp_of_scaled_scores():
    q, k, v = torch.randn(1, 1, 8, dtype=torch.float64), torch.randn(1, 7, 8, dtype=torch.float64), torch.randn(1, 7, 8, dtype=torch.float64)
    part = partial_attention(q, k, v)
    expected = torch.logsumexp((q @ k.transpose(1, 2)) / math.sqrt(8), dim=-1)
    assert torch.allclose(part.lse, expected)


@settings(max_examples=40, deadline=None)
@given(blocks=st.integers(1, 12), tokens=st.integers(1, 16), kv_heads=st.integers(1, 3), group=st.integers(1, 3),
       seed=st.integers(0, 2**31))
def test_quest_bound_is_an_upper_bound_on_every_key_score(blocks, tokens, kv_heads, group, seed):
    g = torch.Generator().manual_seed(seed)
    head_dim = 8
    kb = torch.randn(blocks, kv_heads, tokens, head_dim, generator=g) * 3
    q = torch.randn(kv_heads * group, 1, head_dim, generator=g)
    kmin, kmax = block_summaries(kb)
    bound = block_bounds(q, kmin, kmax)  # [kv, blocks, g]
    grouped = q.reshape(kv_heads, group, head_dim)
    scores = torch.einsum("hgd,bhtd->hbgt", grouped, kb) / math.sqrt(head_dim)
    assert (scores.amax(dim=-1) <= bound + 1e-4).all()


def test_the_block_holding_a_planted_needle_scores_highest():
    g = torch.Generator().manual_seed(3)
    kb = torch.randn(50, 2, 16, 8, generator=g)
    u = torch.randn(8, generator=g)
    u /= u.norm()
    kb[17] = 12 * u + torch.randn(2, 16, 8, generator=g) * 0.1
    q = (math.sqrt(8) * u).expand(4, 1, 8).clone()
    scores = block_scores(q, *block_summaries(kb))
    assert int(scores.argmax()) == 17


def test_selection_keeps_sink_and_recent_and_fills_the_budget_by_score():
    scores = torch.tensor([0.0, 5.0, 1.0, 9.0, 2.0, 8.0, 0.5, 0.1])
    selected, candidates = select_blocks(scores, 4, sink=1, recent=1, spare=2)
    assert selected == [0, 3, 5, 7]
    assert candidates == [1, 4]
    assert select_blocks(scores, 8)[0] == list(range(8))
    assert select_blocks(scores, 2, sink=1, recent=1)[0] == [0, 7]


def test_selection_refuses_a_zero_budget():
    with pytest.raises(ValueError, match="budget"):
        select_blocks(torch.zeros(4), 0)


def test_partial_type_carries_out_and_lse():
    part = Partial(torch.zeros(1, 1, 2), torch.zeros(1, 1))
    assert part.out.shape == (1, 1, 2)
