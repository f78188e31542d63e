"""The decode-loop API (``TieredKVCache``): exact attention over KV spread across HBM, DRAM
and NVMe equals a float64 dense reference; sparse attention with a full budget equals
exact; prefix reuse, namespaces, bad input, capacity, and the record -> replay round trip."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache import AttentionMode, TieredKVCache
from tiercache.attention import dense_reference
from tiercache.cli import main as cli_main
from tiercache.config import KVLayout, TierConfig
from tiercache.errors import UserError

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-3}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _tiers(hbm: int, dram: int, nvme: int) -> list[TierConfig]:
    return [TierConfig("hbm", hbm), TierConfig("dram", dram), TierConfig("nvme", nvme)]


def _cache(tmp_path, layout: KVLayout, hbm=3, dram=3, nvme=64, **options) -> TieredKVCache:
    options.setdefault("device", "cpu")  # the tests build CPU tensors; the GPU test below asks for CUDA
    return TieredKVCache(layout, _tiers(hbm, dram, nvme), path=tmp_path / "nvme", **options)


class _Model:
    """Random KV and queries for a few layers, kept for the dense reference."""

    def __init__(self, layout: KVLayout, q_heads: int, dtype: torch.dtype, seed: int) -> None:
        self.layout, self.q_heads, self.dtype = layout, q_heads, dtype
        self.g = torch.Generator().manual_seed(seed)
        self.k = [[] for _ in range(layout.layers)]
        self.v = [[] for _ in range(layout.layers)]

    def kv(self, layer: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.layout.kv_heads, t, self.layout.head_dim)
        k = torch.randn(shape, generator=self.g).to(self.dtype)
        v = torch.randn(shape, generator=self.g).to(self.dtype)
        self.k[layer].append(k)
        self.v[layer].append(v)
        return k, v

    def query(self) -> torch.Tensor:
        return (torch.randn(self.q_heads, 1, self.layout.head_dim, generator=self.g) * 1.5).to(self.dtype)

    def reference(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return dense_reference(q, torch.cat(self.k[layer], 1), torch.cat(self.v[layer], 1))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([8, 16]),
       block_tokens=st.sampled_from([4, 8]), prompt=st.integers(1, 70), steps=st.integers(1, 4),
       chunk=st.integers(1, 40), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       seed=st.integers(0, 2**31))
def test_exact_attention_equals_float64_dense_across_three_tiers(tmp_path_factory, kv_heads, group, head_dim, block_tokens,
                                                                  prompt, steps, chunk, dtype, seed):
    layout = KVLayout(2, kv_heads, head_dim, DTYPE_NAMES[dtype], block_tokens)
    model = _Model(layout, kv_heads * group, dtype, seed)
    with _cache(tmp_path_factory.mktemp("c"), layout, hbm=2, dram=2, window_blocks=3) as cache:
        seq = cache.sequence()
        for layer in range(2):
            for a in range(0, prompt, chunk):  # prefill in appends of t > 1, not block aligned
                seq.append(layer, *model.kv(layer, min(chunk, prompt - a)))
        for _ in range(steps):
            for layer in range(2):
                seq.append(layer, *model.kv(layer, 1))
                q = model.query()
                out = seq.attend(layer, q)
                assert out.shape == q.shape and out.dtype == torch.float32
                assert _rel(out, model.reference(layer, q)) <= TOLERANCE[dtype]
        cache.check_invariants()


def test_kv_really_spreads_over_all_three_tiers_and_sparse_full_budget_equals_exact(tmp_path):
    layout = KVLayout(1, 2, 16, "float32", 8)
    model = _Model(layout, 4, torch.float32, 1)
    with _cache(tmp_path, layout, hbm=3, dram=3, window_blocks=2) as cache:
        seq = cache.sequence()
        seq.append(0, *model.kv(0, 100))
        names = [cache.manager.dirs[cache.manager.locate(int(b))].name for b in seq._layers[0].ids[: seq.blocks(0)]]
        assert {"hbm", "dram", "nvme"} <= set(names)
        q = model.query()
        exact = seq.attend(0, q)
        sparse = seq.attend(0, q, AttentionMode.SPARSE, budget=1.0)
        count = seq.attend(0, q, AttentionMode.SPARSE, budget=seq.blocks(0))
        ref = model.reference(0, q)
        assert _rel(exact, ref) <= 1e-5 and _rel(sparse, ref) <= 1e-5 and _rel(count, ref) <= 1e-5
        report = seq.reports[0]
        assert report.selected == seq.blocks(0) and report.hbm_hits + report.from_dram + report.from_nvme == report.selected


def test_sparse_mode_finds_a_needle_block_with_a_small_budget(tmp_path):
    layout = KVLayout(1, 2, 16, "float32", 8)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 8 * 64, 16, generator=g)
    v = torch.randn(2, 8 * 64, 16, generator=g)
    u = torch.randn(16, generator=g)
    u /= u.norm()
    needle = 37
    k[:, needle * 8 : needle * 8 + 8] = 6 * u + torch.randn(2, 8, 16, generator=g)
    with _cache(tmp_path, layout, hbm=4, dram=4, nvme=80) as cache:
        seq = cache.sequence()
        seq.append(0, k, v)
        q = (4 * u + 0.2 * torch.randn(4, 1, 16, generator=g)).float()
        seq.attend(0, q, AttentionMode.SPARSE, budget=4)
        assert needle in seq.last_positions.tolist()
        assert {0, 63} <= set(seq.last_positions.tolist())  # sink and recent always kept
        assert len(seq.last_positions) == 4


def test_a_freed_sequence_is_found_by_a_later_prompt_and_reused(tmp_path):
    layout = KVLayout(2, 1, 8, "float32", 4)
    tokens = list(range(100, 123))  # 5 full blocks + 3 tokens
    model = _Model(layout, 2, torch.float32, 2)
    with _cache(tmp_path, layout, hbm=4, dram=4) as cache:
        first = cache.sequence(tokens=tokens, namespace="tenant-a")
        assert first.cached_tokens == 0
        for layer in range(2):
            first.append(layer, *model.kv(layer, len(tokens)))
        first.free()
        assert cache.match_prefix(tokens, namespace="tenant-a") == 20
        assert cache.match_prefix(tokens, namespace="tenant-b") == 0
        assert cache.match_prefix([7, *tokens[1:]], namespace="tenant-a") == 0
        second = cache.sequence(tokens=tokens + [5, 6], namespace="tenant-a")
        assert second.cached_tokens == 20
        for layer in range(2):  # the rest of the prompt, from the cached position on
            k = torch.cat(model.k[layer], 1)[:, 20:]
            v = torch.cat(model.v[layer], 1)[:, 20:]
            second.append(layer, k, v)
            second.append(layer, *model.kv(layer, 2))
            q = model.query()
            assert _rel(second.attend(layer, q), model.reference(layer, q)) <= 1e-5
        other = cache.sequence(tokens=tokens, namespace="tenant-b")
        assert other.cached_tokens == 0
        cache.check_invariants()


def test_live_blocks_are_never_dropped_while_free_ones_are(tmp_path):
    layout = KVLayout(1, 1, 8, "float32", 4)
    with _cache(tmp_path, layout, hbm=2, dram=2, nvme=8) as cache:
        old = cache.sequence()
        old.append(0, torch.randn(1, 24, 8), torch.randn(1, 24, 8))  # 6 blocks
        old.free()
        live = cache.sequence()
        live.append(0, torch.randn(1, 40, 8), torch.randn(1, 40, 8))  # 10 blocks: old ones must go
        assert all(cache.manager.locate(int(b)) is not None for b in live._layers[0].ids[:10])
        cache.check_invariants()


def test_a_sequence_longer_than_the_tiers_is_refused_before_anything_moves(tmp_path):
    layout = KVLayout(1, 1, 8, "float32", 4)
    with _cache(tmp_path, layout, hbm=2, dram=2, nvme=4) as cache:
        seq = cache.sequence()
        seq.append(0, torch.randn(1, 20, 8), torch.randn(1, 20, 8))
        before = json.dumps(cache.stats()["tiers"])
        with pytest.raises(UserError, match=r"3 more block\(s\) \(768 bytes\)"):
            seq.append(0, torch.randn(1, 24, 8), torch.randn(1, 24, 8))
        assert json.dumps(cache.stats()["tiers"]) == before
        assert seq.length(0) == 20


@pytest.mark.parametrize("call, message", [
    (lambda s: s.append(0, torch.randn(3, 2, 8), torch.randn(3, 2, 8)), "kv_heads=2"),
    (lambda s: s.append(0, torch.randn(2, 2, 4), torch.randn(2, 2, 4)), "head_dim=8"),
    (lambda s: s.append(0, torch.randn(2, 2, 8).half(), torch.randn(2, 2, 8).half()), "torch.float32"),
    (lambda s: s.append(0, torch.randn(2, 0, 8), torch.randn(2, 0, 8)), "t>=1"),
    (lambda s: s.append(0, torch.randn(2, 2, 8), torch.randn(2, 3, 8)), "differ in shape"),
    (lambda s: s.append(2, torch.randn(2, 2, 8), torch.randn(2, 2, 8)), r"layer must be an integer in \[0, 2\)"),
    (lambda s: s.append(-1, torch.randn(2, 2, 8), torch.randn(2, 2, 8)), "layer must be"),
    (lambda s: s.attend(0, torch.randn(3, 1, 8)), "multiple of kv_heads=2"),
    (lambda s: s.attend(0, torch.randn(4, 2, 8)), r"\[q_heads"),
    (lambda s: s.attend(0, torch.randn(4, 1, 8).double()), "torch.float32"),
    (lambda s: s.attend(5, torch.randn(4, 1, 8)), "layer must be"),
    (lambda s: s.attend(0, torch.randn(4, 1, 8), mode="sparse", budget=0.1), "AttentionMode"),
    (lambda s: s.attend(0, torch.randn(4, 1, 8), AttentionMode.SPARSE, budget=0), "at least one block"),
    (lambda s: s.attend(0, torch.randn(4, 1, 8), AttentionMode.SPARSE, budget=0.0), r"\(0, 1\]"),
    (lambda s: s.attend(0, torch.randn(4, 1, 8), AttentionMode.SPARSE), "needs a budget"),
    (lambda s: s.attend(0, torch.randn(4, 1, 8), AttentionMode.EXACT, budget=0.5), "SPARSE only"),
    (lambda s: s.attend(1, torch.randn(4, 1, 8)), "no KV yet"),
])
def test_bad_input_is_refused_with_a_clear_message(tmp_path, call, message):
    layout = KVLayout(2, 2, 8, "float32", 4)
    with _cache(tmp_path, layout) as cache:
        seq = cache.sequence()
        seq.append(0, torch.randn(2, 9, 8), torch.randn(2, 9, 8))
        with pytest.raises(UserError, match=message):
            call(seq)
        assert seq.length(0) == 9
        cache.check_invariants()


def test_a_wrong_device_is_refused(tmp_path):
    layout = KVLayout(1, 1, 8, "float32", 4)
    with _cache(tmp_path, layout) as cache:
        seq = cache.sequence()
        with pytest.raises(UserError, match="must be on cpu"):
            seq.append(0, torch.randn(1, 2, 8, device="meta"), torch.randn(1, 2, 8, device="meta"))


def test_attend_on_a_freed_sequence_is_refused_and_free_releases_holds(tmp_path):
    layout = KVLayout(1, 1, 8, "float32", 4)
    with _cache(tmp_path, layout) as cache:
        seq = cache.sequence()
        seq.append(0, torch.randn(1, 12, 8), torch.randn(1, 12, 8))
        assert len(cache.manager.held) == 3
        seq.free()
        seq.free()  # idempotent
        assert cache.manager.held == {}
        with pytest.raises(UserError, match="freed"):
            seq.attend(0, torch.randn(1, 1, 8))
        with pytest.raises(UserError, match="freed"):
            seq.append(0, torch.randn(1, 1, 8), torch.randn(1, 1, 8))


def test_a_corrupt_nvme_chunk_is_an_error_never_wrong_attention(tmp_path):
    layout = KVLayout(1, 1, 8, "float32", 4)
    with _cache(tmp_path, layout, hbm=1, dram=1) as cache:
        seq = cache.sequence()
        seq.append(0, torch.randn(1, 40, 8), torch.randn(1, 40, 8))
        nvme = cache.store._media[2]
        key = next(k for k in seq._layers[0].keys if nvme.contains(k))
        path = nvme.chunk_path(nvme.slot_of(key))
        with open(path, "r+b") as f:
            f.seek(10)
            f.write(b"\xff\xfe\xfd")
        with pytest.raises(RuntimeError, match="unreadable"):
            seq.attend(0, torch.randn(1, 1, 8))
        assert cache.stats()["tiers"][2]["lost"] == 1
        cache.check_invariants()


def _decode_run(tmp_path, record, prefetch: str) -> list[int]:
    layout = KVLayout(2, 2, 8, "float32", 4)
    model = _Model(layout, 4, torch.float32, 11)
    with TieredKVCache(layout, _tiers(5, 6, 60), path=tmp_path / "nvme", record=record, prefetch=prefetch, device="cpu",
                       window_blocks=2) as cache:
        a = cache.sequence()
        b = cache.sequence(tokens=list(range(30)), namespace="x")
        for layer in range(2):
            a.append(layer, *model.kv(layer, 37))
            b.append(layer, *model.kv(layer, 30))
        for step in range(12):
            for layer in range(2):
                for seq in (a, b):
                    seq.append(layer, *model.kv(layer, 1))
                    mode = AttentionMode.EXACT if step % 3 == 0 else AttentionMode.SPARSE
                    seq.attend(layer, model.query(), mode, None if mode is AttentionMode.EXACT else 3)
            if step == 6:
                b.free()
                b = cache.sequence(tokens=list(range(30)), namespace="x")  # reuses the freed prefix
                for layer in range(2):
                    b.append(layer, *model.kv(layer, 30 - b.cached_tokens))
        cache.check_invariants()
        return [t["hits"] for t in cache.stats()["tiers"]] + [t["promotions"] for t in cache.stats()["tiers"]]


@pytest.mark.parametrize("prefetch", ["none", "layer_ahead", "topk_speculative"])
def test_a_recorded_run_replays_to_the_same_per_tier_counts(tmp_path, prefetch):
    record = tmp_path / "steps.jsonl"
    live = _decode_run(tmp_path, record, prefetch)
    out = tmp_path / "replay.json"
    code = cli_main(["replay", str(record), "--tiers", "hbm=5,dram=6,nvme=60", "--prefetch", prefetch,
                     "--out", str(out), "--no-progress"])
    assert code == 0
    tiers = json.loads(out.read_text())["runs"][0]["tiers"]
    assert [t["hits"] for t in tiers] + [t["promotions"] for t in tiers] == live
    assert sum(live[:3]) > 0 and live[3 + 1] + live[3 + 2] > 0


def test_speculative_prefetch_brings_up_blocks_a_step_early(tmp_path):
    layout = KVLayout(1, 1, 16, "float32", 4)
    g = torch.Generator().manual_seed(0)
    with TieredKVCache(layout, _tiers(12, 8, 80), path=tmp_path / "nvme", prefetch="topk_speculative", device="cpu") as cache:
        seq = cache.sequence()
        seq.append(0, torch.randn(1, 240, 16, generator=g), torch.randn(1, 240, 16, generator=g))
        base = torch.randn(1, 1, 16, generator=g)
        for _ in range(6):
            seq.attend(0, base + 0.3 * torch.randn(1, 1, 16, generator=g), AttentionMode.SPARSE, budget=6)
        assert sum(r.prefetched for r in seq.reports) > 0
        later = seq.reports[2:]
        assert sum(r.hbm_hits for r in later) / sum(r.selected for r in later) > 0.5


def test_exact_mode_reads_in_place_and_moves_nothing(tmp_path):
    layout = KVLayout(1, 1, 8, "float32", 4)
    with _cache(tmp_path, layout, hbm=2, dram=2, prefetch="none") as cache:
        seq = cache.sequence()
        seq.append(0, torch.randn(1, 40, 8), torch.randn(1, 40, 8))
        where = [cache.manager.locate(int(b)) for b in seq._layers[0].ids[:10]]
        seq.attend(0, torch.randn(1, 1, 8))
        assert [cache.manager.locate(int(b)) for b in seq._layers[0].ids[:10]] == where
        tiers = cache.stats()["tiers"]
        assert tiers[2]["hits"] == 6 and tiers[2]["promotions"] == 0 and tiers[2]["hits_in_place"] == 6
        assert tiers[2]["promote_skipped"] == 0  # a streaming read tries no promotion: none skipped


def test_readme_style_decode_loop_runs(tmp_path):
    layout = KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="float32", block_tokens=16)
    cache = TieredKVCache(layout, _tiers(8, 16, 256), path=tmp_path / "nvme", device="cpu")
    seq = cache.sequence()
    for layer in range(2):
        seq.append(layer, torch.randn(2, 300, 16), torch.randn(2, 300, 16))
    for _ in range(3):
        for layer in range(2):
            seq.append(layer, torch.randn(2, 1, 16), torch.randn(2, 1, 16))
            out = seq.attend(layer, torch.randn(4, 1, 16), AttentionMode.SPARSE, budget=0.25)
            assert torch.isfinite(out).all() and not math.isnan(float(out.sum()))
    seq.free()
    cache.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_exact_and_sparse_on_the_gpu_equal_the_float64_reference(tmp_path, dtype):
    layout = KVLayout(2, 2, 16, DTYPE_NAMES[dtype], 8)
    model = _Model(layout, 4, dtype, 7)
    with _cache(tmp_path, layout, hbm=3, dram=3, window_blocks=2, device="cuda") as cache:
        seq = cache.sequence()
        for layer in range(2):
            seq.append(layer, *(x.cuda() for x in model.kv(layer, 90)))
        for layer in range(2):
            q = model.query()
            ref = model.reference(layer, q)
            assert _rel(seq.attend(layer, q.cuda()).cpu(), ref) <= TOLERANCE[dtype]
            assert _rel(seq.attend(layer, q.cuda(), AttentionMode.SPARSE, budget=1.0).cpu(), ref) <= TOLERANCE[dtype]
        cache.check_invariants()


@pytest.mark.parametrize("tokens, error", [([2**64] * 20, ValueError), ([1.5] * 20, TypeError), ([True] * 20, TypeError)])
def test_sequence_refuses_token_ids_it_would_convert(tokens, error):
    """Token ids past int64 raised a bare OverflowError; floats and bools were hashed as
    silently converted integers. A ``[1, n]`` tensor of ids is still taken as it is."""
    layout = KVLayout(layers=1, kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
    cache = TieredKVCache(layout, [TierConfig("hbm", 8)])
    try:
        with pytest.raises(error, match="^tokens: "):
            cache.sequence(tokens=tokens)
        assert cache.sequence(tokens=torch.arange(20).view(1, 20)).cached_tokens == 0
    finally:
        cache.close()


def test_device_bytes_counts_the_hbm_pool_and_the_read_window_once_allocated():
    layout = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
    with TieredKVCache(layout, [TierConfig("hbm", 6), TierConfig("dram", 6)], device="cpu", window_blocks=3, depth=2) as cache:
        block = 2 * 2 * 4 * 8 * 2  # K and V, kv heads, tokens, head dim, fp16 bytes (one layer's block)
        assert cache.device_bytes() == 6 * block  # no read yet: the window is not allocated
        seq = cache.sequence()
        for layer in range(2):
            seq.append(layer, torch.randn(2, 9, 8).half(), torch.randn(2, 9, 8).half())
        seq.attend(0, torch.randn(4, 1, 8).half())
        window = 2 * (3 * block + 2 * (2 * 3 * 4 * 8 * 4))  # depth x (raw blocks + float32 K and V)
        assert cache.device_bytes() == 6 * block + window
