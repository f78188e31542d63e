"""Probe findings on decode attention, the live cache's prefix match and ``tiercache bench``:
overflow-safe exact and sparse attention (checked against a float64 reference), a Quest bound
that bounds under rounding, distinct block selections, shape checks of ``stream_attention``,
``match_prefix`` validating tokens as ``sequence()`` does, and no empty bench round."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from tiercache import AttentionMode, TieredKVCache
from tiercache.attention import block_bounds, block_scores, block_summaries, dense_reference, select_blocks, stream_attention
from tiercache.bench.measure import MIN_BLOCKS, Bench
from tiercache.bench.tiers import QUICK_LAYOUT, BenchConfig
from tiercache.cli import main as cli_main
from tiercache.config import KVLayout, TierConfig
from tiercache.errors import UserError


class _Chunks:
    """A ChunkSource over ``k``/``v`` cut into chunks of ``size`` keys; counts its fetches."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, size: int) -> None:
        self.k, self.v, self.size = k, v, size
        self.n = -(-k.shape[1] // size)
        self.starts = 0

    def start(self, index, buffer):
        self.starts += 1
        return index

    def finish(self, index):
        return self.k[:, index * self.size : (index + 1) * self.size], self.v[:, index * self.size : (index + 1) * self.size]


def _streamed(q, k, v, size=3):
    source = _Chunks(k, v, size)
    return stream_attention(q, k.shape[0], source, source.n), source


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


# -- #4: scores beyond float32's range ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("magnitude", [1e19, 1e20, 1e30])
def test_exact_attention_of_huge_kv_matches_the_float64_reference(dtype, magnitude):
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        q = (torch.randn(4, 1, 16, generator=g) * magnitude).to(dtype)
        k = (torch.randn(2, 11, 16, generator=g) * magnitude).to(dtype)
        v = torch.randn(2, 11, 16, generator=g).to(dtype)
        out, _ = _streamed(q, k, v)
        ref = dense_reference(q, k, v)
        assert torch.isfinite(ref).all() and torch.isfinite(out).all()
        assert _rel(out, ref) <= 1e-5


def test_a_score_whose_float32_sum_overflows_on_the_way_is_recomputed():
    # products of +-3e38: a float32 partial sum overflows to -inf though the exact score is 0,
    # while the other key's score is finite; the overflowed key must still get its weight
    q = torch.full((1, 1, 4), 1e19)
    k = torch.tensor([[[-3e19, -3e19, 3e19, 3e19], [0.0, 0.0, 0.0, -1e-19]]])
    v = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [-1.0, -2.0, -3.0, -4.0]]])
    out, _ = _streamed(q, k, v, size=2)
    assert _rel(out, dense_reference(q, k, v)) <= 1e-6


def test_keys_tied_across_chunks_at_huge_scores_keep_their_count():
    # three equal top scores of 2**80 in three chunks: log(2) next to 2**80 rounds away in
    # float32, so a merge by log-sum-exp alone weighs them 1:1 and then (1+1):1
    q = torch.full((1, 1, 1), 2.0**40)
    k = torch.tensor([2.0**40, -1.0, 2.0**40, -1.0, 2.0**40]).reshape(1, 5, 1)
    v = torch.tensor([1.0, 0.0, 2.0, 0.0, 6.0]).reshape(1, 5, 1)
    out, _ = _streamed(q, k, v, size=2)
    assert out.item() == pytest.approx(3.0, rel=1e-6) and dense_reference(q, k, v).item() == pytest.approx(3.0)


def test_normal_inputs_read_every_chunk_once_overflowing_ones_twice():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(4, 1, 8, generator=g), torch.randn(2, 20, 8, generator=g), torch.randn(2, 20, 8, generator=g)
    _, source = _streamed(q, k, v, size=4)
    assert source.starts == source.n == 5
    _, source = _streamed(q * 1e20, k * 1e20, v, size=4)
    assert source.starts == 2 * source.n


@pytest.mark.parametrize("mode", [AttentionMode.EXACT, AttentionMode.SPARSE])
def test_live_cache_attends_over_huge_bf16_kv_without_nan(tmp_path, mode):
    layout = KVLayout(layers=1, kv_heads=1, head_dim=8, dtype="bfloat16", block_tokens=4)
    g = torch.Generator().manual_seed(0)
    with TieredKVCache(layout, [TierConfig("hbm", 8)], device="cpu") as cache:
        seq = cache.sequence()
        k = (torch.randn(1, 10, 8, generator=g) * 1e20).bfloat16()
        v = torch.randn(1, 10, 8, generator=g).bfloat16()
        seq.append(0, k, v)
        q = (torch.randn(2, 1, 8, generator=g) * 1e20).bfloat16()
        budget = None if mode is AttentionMode.EXACT else 2
        out = seq.attend(0, q, mode, budget=budget)
        assert torch.isfinite(out).all()
        if mode is AttentionMode.EXACT:
            assert _rel(out, dense_reference(q, k, v)) <= 1e-5


def test_block_scores_of_huge_kv_are_finite_and_rank_the_needle_first():
    g = torch.Generator().manual_seed(1)
    kb = torch.randn(6, 1, 4, 8, generator=g) * 1e18
    kb[3, 0, 2] = torch.full((8,), 3e19)
    q = torch.full((2, 1, 8), 1e20)
    scores = block_scores(q, *block_summaries(kb))
    assert not torch.isnan(scores).any() and int(scores.argmax()) == 3


# -- #7: the Quest bound under rounding ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("magnitude", [1e-20, 1.0, 100.0, 1e20])
def test_quest_bound_is_above_every_exact_key_score(dtype, magnitude):
    magnitude = min(max(magnitude, 1e-3), 100.0) if dtype == torch.float16 else magnitude  # within fp16's range
    g = torch.Generator().manual_seed(2)
    for tokens in (1, 3, 16):
        kb = (torch.randn(40, 2, tokens, 64, generator=g) * magnitude).to(dtype)
        q = (torch.randn(4, 1, 64, generator=g) * magnitude).to(dtype)
        bound = block_bounds(q, *block_summaries(kb)).double()  # [kv, blocks, g]
        exact = torch.einsum("hgd,bhtd->hbgt", q.double().reshape(2, 2, 64), kb.double()) / 8
        assert (exact.amax(dim=-1) <= bound).all()


# -- #3: selections are distinct ----------------------------------------------------------------------
def test_selection_of_minus_infinity_scores_is_distinct():
    selected, candidates = select_blocks(torch.full((9,), -math.inf), budget=8, sink=0, recent=2, spare=4)
    assert sorted(set(selected)) == selected and len(selected) == 8 and not set(selected) & set(candidates)
    selected, candidates = select_blocks(torch.tensor([-1.6, -math.inf, 0.48, 2.66, -0.46]), budget=4, sink=0, recent=1, spare=4)
    assert selected == [0, 2, 3, 4] and candidates == [1]


def test_random_selections_with_non_finite_scores_are_distinct_and_disjoint():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        n = int(rng.integers(1, 14))
        scores = torch.from_numpy(rng.choice([-math.inf, math.inf, math.nan, 0.0, 1.0, -2.0], n)).float()
        budget, sink, recent, spare = (int(x) for x in rng.integers(0, 5, 4))
        selected, candidates = select_blocks(scores, budget + 1, sink, recent, spare)
        assert len(set(selected)) == len(selected) == min(budget + 1, n)
        assert len(set(candidates)) == len(candidates) and not set(selected) & set(candidates)
        assert set(range(min(sink, n))) <= set(selected) or len(selected) == budget + 1


def test_selection_takes_a_numpy_budget_and_refuses_bools_and_floats():
    scores = torch.tensor([0.0, 5.0, 1.0, 9.0, 2.0])
    assert select_blocks(scores, np.int64(3))[0] == [0, 3, 4]
    for bad in (True, 2.0):
        with pytest.raises(TypeError, match="budget must be an integer"):
            select_blocks(scores, bad)


# -- #6: stream_attention checks its shapes -----------------------------------------------------------
@pytest.mark.parametrize("kv_heads, k_shape, v_shape, message", [
    (2, (2, 10, 8), (1, 10, 8), "chunk 0: k and v must both be"),   # V would broadcast
    (2, (1, 10, 8), (1, 10, 8), "chunk 0: k and v must both be"),   # kv_heads does not match the tensors
    (2, (2, 10, 8), (2, 10, 4), "chunk 0: k and v must both be"),
    (2, (2, 0, 8), (2, 0, 8), "no keys to attend to"),
    (0, (2, 10, 8), (2, 10, 8), "kv_heads must be a positive integer"),
    (3, (3, 10, 8), (3, 10, 8), "q must be"),
])
def test_stream_attention_refuses_mismatched_or_empty_input(kv_heads, k_shape, v_shape, message):
    source = _Chunks(torch.randn(k_shape), torch.randn(v_shape), 20)
    with pytest.raises(ValueError, match=message):
        stream_attention(torch.randn(8, 1, 8), kv_heads, source, 1)


def test_stream_attention_checks_extra_chunks_too():
    with pytest.raises(ValueError, match="extra chunk 0"):
        stream_attention(torch.randn(2, 1, 8), 2, _Chunks(torch.randn(2, 4, 8), torch.randn(2, 4, 8), 4), 1,
                         extra=[(torch.randn(2, 1, 8), torch.randn(1, 1, 8))])


# -- #5: match_prefix checks tokens as sequence() does ------------------------------------------------
@pytest.fixture
def stored_prompt():
    layout = KVLayout(layers=1, kv_heads=1, head_dim=8, dtype="float16", block_tokens=4)
    prompt = list(range(1, 10))
    with TieredKVCache(layout, [TierConfig("hbm", 8), TierConfig("dram", 8)], device="cpu") as cache:
        seq = cache.sequence(tokens=prompt)
        seq.append(0, torch.randn(1, 9, 8).half(), torch.randn(1, 9, 8).half())
        seq.free()
        yield cache, prompt


def test_match_prefix_refuses_float_token_ids(stored_prompt):
    cache, prompt = stored_prompt
    assert cache.match_prefix(prompt) == 8
    with pytest.raises(TypeError, match="tokens: .*integers"):
        cache.match_prefix([t + 0.7 for t in prompt])
    with pytest.raises(TypeError, match="tokens"):
        cache.match_prefix([True] * 9)


def test_match_prefix_takes_an_input_ids_tensor_and_names_huge_ids(stored_prompt):
    cache, prompt = stored_prompt
    assert cache.match_prefix(torch.tensor([prompt])) == 8
    with pytest.raises(ValueError, match="tokens: .*int64"):
        cache.match_prefix([1, 2**64])


# -- #2: no bench round times an empty operation ------------------------------------------------------
def test_bench_refuses_a_single_block_before_making_its_folder(tmp_path, capsys):
    assert cli_main(["bench", "--blocks", "1", "--dir", str(tmp_path), "--json", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--blocks must be at least 2" in err and len(err.splitlines()) == 1
    assert os.listdir(tmp_path) == []
    with pytest.raises(UserError, match="--blocks"):
        Bench(BenchConfig(QUICK_LAYOUT, 1, 1, 1, str(tmp_path), False, 0))


@pytest.mark.parametrize("blocks", [MIN_BLOCKS, 3, 15])
def test_small_bench_runs_give_every_side_blocks_in_every_round(tmp_path, blocks):
    bench = Bench(BenchConfig(QUICK_LAYOUT, blocks, 1, 1, str(tmp_path), False, 0))
    try:
        slices = bench._slices()
        assert all(part.size >= MIN_BLOCKS for part in slices) and sum(p.size for p in slices) == blocks
        samples = bench.repeat()
    finally:
        bench.close()
    for group in ("paired", "paired_file"):
        ratios = samples[group]["disk_read_cold"]
        assert len(ratios) == len(slices) and all(r > 0 and math.isfinite(r) for r in ratios), ratios


def test_sequence_budget_takes_numpy_integers_and_names_a_wrong_type():
    layout = KVLayout(layers=1, kv_heads=1, head_dim=8, dtype="float32", block_tokens=4)
    g = torch.Generator().manual_seed(3)
    with TieredKVCache(layout, [TierConfig("hbm", 8)], device="cpu") as cache:
        seq = cache.sequence()
        seq.append(0, torch.randn(1, 20, 8, generator=g), torch.randn(1, 20, 8, generator=g))
        q = torch.randn(2, 1, 8, generator=g)
        plain = seq.attend(0, q, AttentionMode.SPARSE, budget=2)
        chosen = seq.last_positions.tolist()
        assert torch.equal(seq.attend(0, q, AttentionMode.SPARSE, budget=np.int64(2)), plain)
        assert seq.last_positions.tolist() == chosen
        with pytest.raises(UserError, match="got bool True"):
            seq.attend(0, q, AttentionMode.SPARSE, budget=True)
        with pytest.raises(UserError, match="got str"):
            seq.attend(0, q, AttentionMode.SPARSE, budget="2")


def test_fp16_inputs_skip_the_overflow_check_because_their_scores_cannot_overflow():
    from tiercache.attention import may_overflow as _wide

    assert not _wide(torch.zeros(1, dtype=torch.float16), torch.zeros(1, dtype=torch.float16))
    assert _wide(torch.zeros(1, dtype=torch.bfloat16)) and _wide(torch.zeros(1, dtype=torch.float32))
    top = torch.finfo(torch.float16).max  # the worst fp16 case: every product at 65504**2
    q = torch.full((4, 1, 256), top, dtype=torch.float16)
    k = torch.full((2, 9, 256), top, dtype=torch.float16)
    v = torch.full((2, 9, 256), top, dtype=torch.float16)
    out, _ = _streamed(q, k, v)
    assert torch.isfinite(out).all() and _rel(out, dense_reference(q, k, v)) <= 1e-3
