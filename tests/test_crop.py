"""Cropping a live sequence (``Sequence.crop``) and the ``transformers`` cache's ``crop``
(speculative decoding: assisted decoding and prompt lookup).

Equivalence: after random appends and crops (in the tail, on a block boundary, inside a block
that spilled to DRAM or NVMe, to 0), a sequence attends exactly as a float64 dense reference
over the KV it kept plus what it appended since; a quantised tier's cut block comes back within
its codec's error. Exact ids: the dropped blocks' holds are released (and nothing else's), they
stay stored, content keys of the kept prefix still match, and a recorded run with crops replays
to the same per-tier counts. ``transformers``: prompt lookup and assisted decoding give the same
greedy tokens as ``DynamicCache``. Bad input: a keep out of range, a freed sequence, a positive
transformers crop.
"""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache import AttentionMode, TieredKVCache
from tiercache.attention import dense_reference
from tiercache.config import KVLayout, TierConfig
from tiercache.errors import UserError
from test_fork import assert_replays_to  # a step record replays to the live counts

LAYOUT = KVLayout(2, 2, 8, "float32", 4)


def _cache(path, hbm: int = 3, dram: int = 3, nvme: int = 80, codec: str = "none", **options) -> TieredKVCache:
    tiers = [TierConfig("hbm", hbm), TierConfig("dram", dram), TierConfig("nvme", nvme, codec=codec)]
    return TieredKVCache(LAYOUT, tiers, path=path / "nvme", device="cpu", window_blocks=2, **options)


class _Kept:
    """The KV a sequence should hold per layer, for the dense reference."""

    def __init__(self) -> None:
        self.k = [torch.zeros(LAYOUT.kv_heads, 0, LAYOUT.head_dim) for _ in range(LAYOUT.layers)]
        self.v = [torch.zeros(LAYOUT.kv_heads, 0, LAYOUT.head_dim) for _ in range(LAYOUT.layers)]

    def append(self, seq, t: int, g: torch.Generator) -> None:
        for layer in range(LAYOUT.layers):
            k = torch.randn(LAYOUT.kv_heads, t, LAYOUT.head_dim, generator=g)
            v = torch.randn(LAYOUT.kv_heads, t, LAYOUT.head_dim, generator=g)
            seq.append(layer, k, v)
            self.k[layer] = torch.cat([self.k[layer], k], 1)
            self.v[layer] = torch.cat([self.v[layer], v], 1)

    def crop(self, seq, keep: int) -> None:
        seq.crop(keep)
        self.k = [k[:, :keep] for k in self.k]
        self.v = [v[:, :keep] for v in self.v]

    def error(self, seq, g: torch.Generator) -> float:
        worst = 0.0
        for layer in range(LAYOUT.layers):
            assert seq.length(layer) == self.k[layer].shape[1]
            q = torch.randn(4, 1, LAYOUT.head_dim, generator=g)
            want = dense_reference(q, self.k[layer], self.v[layer])
            worst = max(worst, float((seq.attend(layer, q).double() - want).abs().max()))
        return worst


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.integers(1, 14), st.integers(0, 14)), min_size=1, max_size=6),
       seed=st.integers(0, 2**31))
def test_a_cropped_sequence_attends_as_dense_attention_over_what_it_kept(tmp_path_factory, steps, seed):
    g = torch.Generator().manual_seed(seed)
    with _cache(tmp_path_factory.mktemp("c")) as cache:
        seq, kept = cache.sequence(), _Kept()
        for grow, cut in steps:  # append, check, crop back by up to `cut` tokens, check again
            kept.append(seq, grow, g)
            assert kept.error(seq, g) < 1e-5
            kept.crop(seq, max(0, seq.length() - cut))
            assert set(cache.manager.held) == set(seq._held_ids())
            cache.check_invariants()
        kept.append(seq, 3, g)
        assert kept.error(seq, g) < 1e-5
        seq.free()
        assert not cache.manager.held


def test_a_quantised_tiers_cut_block_comes_back_within_its_codecs_error(tmp_path):
    g = torch.Generator().manual_seed(1)
    with _cache(tmp_path, hbm=1, dram=1, codec="int8") as cache:
        seq, kept = cache.sequence(), _Kept()
        kept.append(seq, 30, g)  # the first blocks sit on the INT8 NVMe tier
        assert cache.manager.locate(int(seq._layers[0].ids[1])) == 2
        kept.crop(seq, 6)  # cuts block 1: its first two tokens come back decoded
        kept.append(seq, 5, g)
        assert kept.error(seq, g) < 0.05
        seq.free()


def test_a_crop_releases_its_dropped_blocks_only_and_they_stay_stored(tmp_path):
    g = torch.Generator().manual_seed(2)
    with _cache(tmp_path) as cache:
        prompt = list(range(20))
        seq = cache.sequence(tokens=prompt)
        _Kept().append(seq, 20, g)
        other = seq.fork()  # holds every block once more
        dropped = [int(i) for i in seq._layers[0].ids[2:5]]
        seq.crop(9)  # blocks 0-1 kept, block 2 cut (one token back in the tail), 3-4 dropped
        assert seq.blocks(0) == 2 and seq.length(1) == 9 and len(seq.token_ids) == 9
        assert [cache.manager.held[i] for i in dropped] == [1, 1, 1]  # the fork's holds stay
        other.free()
        assert all(cache.manager.locate(i) is not None for i in dropped)  # released, still stored
        assert cache.match_prefix(prompt) == 20  # their content keys still find them
        seq.free()
        assert not cache.manager.held
        cache.check_invariants()


def test_a_recorded_run_with_crops_replays_to_the_same_per_tier_counts(tmp_path):
    record = tmp_path / "steps.jsonl"
    g = torch.Generator().manual_seed(3)
    with _cache(tmp_path, hbm=5, dram=6, nvme=60, record=record) as cache:
        seq, kept = cache.sequence(), _Kept()
        kept.append(seq, 30, g)
        for step in range(10):
            kept.append(seq, 3, g)  # a draft of 3 tokens, 1-3 of them rejected
            kept.crop(seq, seq.length() - 1 - step % 3)
            for layer in range(LAYOUT.layers):
                seq.attend(layer, torch.randn(4, 1, 8, generator=g), AttentionMode.SPARSE, 3)
        live = [t["hits"] for t in cache.stats()["tiers"]] + [t["promotions"] for t in cache.stats()["tiers"]]
    assert_replays_to(record, "hbm=5,dram=6,nvme=60", live)


@pytest.mark.parametrize("keep", [-1, 11, 2.0, True, None])
def test_a_bad_keep_is_refused_and_changes_nothing(tmp_path, keep):
    g = torch.Generator().manual_seed(4)
    with _cache(tmp_path) as cache:
        seq = cache.sequence()
        _Kept().append(seq, 10, g)
        with pytest.raises(UserError, match=r"keep must be an integer in \[0, 10\]"):
            seq.crop(keep)
        assert seq.length(1) == 10 and seq.blocks(0) == 2
        seq.free()
        with pytest.raises(UserError, match="Sequence.crop: the sequence was freed"):
            seq.crop(0)


# -- transformers -------------------------------------------------------------------------------
def _llama(seed: int, layers: int = 2):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).eval()


def _hf_tiered(model, path) -> TieredKVCache:
    from tiercache.integrations.transformers import kv_layout

    tiers = [TierConfig("hbm", 3), TierConfig("dram", 3), TierConfig("nvme", 400)]
    return TieredKVCache(kv_layout(model.config, torch.float32, 4), tiers, path=path / "nvme", device="cpu")


def _greedy(model, ids, cache=None, **options) -> torch.Tensor:
    extra = {} if cache is None else {"cache": cache}
    return model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0, **extra, **options)


@pytest.mark.parametrize("drafts", ["prompt_lookup", "assistant"])
def test_speculative_decoding_gives_dynamic_caches_greedy_tokens(tmp_path, drafts):
    from tiercache.integrations.transformers import TieredCache, use_tiercache

    model = _llama(7)
    options = {"prompt_lookup_num_tokens": 3} if drafts == "prompt_lookup" else {"assistant_model": _llama(8, layers=1)}
    base = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    ids = torch.cat([base, base, base[:, :5]], 1)  # repeated text: prompt lookup finds drafts that match
    want = _greedy(model, ids, **options)
    assert torch.equal(want, _greedy(model, ids))  # greedy speculative decoding changes no token
    use_tiercache(model)
    with _hf_tiered(model, tmp_path) as kv:
        crops = []
        original = TieredCache.crop
        cache = TieredCache(kv, model)
        cache.crop = lambda n: (crops.append(n), original(cache, n))
        assert torch.equal(_greedy(model, ids, cache, **options), want)
        assert any(n < 0 for n in crops)  # drafts were rejected and cropped
        cache.free()
        assert not kv.manager.held
        kv.check_invariants()


def test_the_transformers_crop_refuses_what_it_cannot_do(tmp_path):
    from tiercache.integrations.transformers import TieredCache, use_tiercache

    model = use_tiercache(_llama(9))
    ids = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    with _hf_tiered(model, tmp_path) as kv:
        cache = TieredCache(kv, model)
        with torch.no_grad():
            model(ids, cache=cache)
        for bad, message in ((3, "negative integer"), (-10, "row 0 holds 9"), (1.0, "negative integer")):
            with pytest.raises(UserError, match=message):
                cache.crop(bad)
        with pytest.raises(UserError, match="every layer at once"):
            cache.layers[0].crop(-1)
        assert cache.get_seq_length() == 9
        cache.crop(-4)
        assert cache.get_seq_length() == 5 and cache.sequences[0].token_ids.tolist() == ids[0, :5].tolist()
        with pytest.raises(UserError, match="holds no rows yet"):  # drafts from a held prompt: refused up front
            model.generate(ids[:, :5], cache=cache, prompt_lookup_num_tokens=2, max_new_tokens=2, pad_token_id=0)
        assert cache.get_seq_length() == 5
        cache.free()


def test_a_crop_whose_release_stops_part_way_gives_the_holds_back(tmp_path, monkeypatch):
    """Probe R9: a release that raised after releasing left the crop's blocks unheld while the
    sequence still listed them, so its free took a fork's holds."""
    g = torch.Generator().manual_seed(5)
    with _cache(tmp_path, hbm=2, dram=2) as cache:
        seq = cache.sequence()
        _Kept().append(seq, 30, g)
        fork = seq.fork()
        release = cache.driver.release

        def release_then_raise(ids):
            release(ids)
            raise RuntimeError("failed after the release")

        monkeypatch.setattr(cache.driver, "release", release_then_raise)
        with pytest.raises(RuntimeError, match="after the release"):
            seq.crop(6)
        monkeypatch.setattr(cache.driver, "release", release)
        assert seq.length(1) == 30
        cache.check_invariants()
        seq.free()
        assert cache.manager.held == dict(collections.Counter(fork._held_ids()))
        fork.free()
        assert not cache.manager.held


def test_an_assistant_readied_with_use_tiercache_is_named(tmp_path):
    from tiercache.integrations.transformers import TieredCache, use_tiercache

    model, assistant = use_tiercache(_llama(7)), use_tiercache(_llama(8, layers=1))
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(6))
    with _hf_tiered(model, tmp_path) as kv:
        cache = TieredCache(kv, model)
        with pytest.raises(UserError, match="assistant_model readied with use_tiercache"):
            _greedy(model, ids, cache, assistant_model=assistant)
        cache.free()
        assert not kv.manager.held


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_forks_and_crops_on_the_gpu_attend_as_the_float64_reference(tmp_path):
    g = torch.Generator().manual_seed(7)
    tiers = [TierConfig("hbm", 3), TierConfig("dram", 3), TierConfig("nvme", 80)]
    with TieredKVCache(LAYOUT, tiers, path=tmp_path / "nvme", device="cuda", window_blocks=2) as cache:
        seq, kept = cache.sequence(), _Kept()
        for grow, keep in ((30, 13), (9, 8), (17, 4)):
            kept.k = [k.cpu() for k in kept.k]
            kept.v = [v.cpu() for v in kept.v]
            for layer in range(LAYOUT.layers):
                k = torch.randn(LAYOUT.kv_heads, grow, LAYOUT.head_dim, generator=g)
                v = torch.randn(LAYOUT.kv_heads, grow, LAYOUT.head_dim, generator=g)
                seq.append(layer, k.cuda(), v.cuda())
                kept.k[layer] = torch.cat([kept.k[layer], k], 1)
                kept.v[layer] = torch.cat([kept.v[layer], v], 1)
            twin = seq.fork()
            kept.crop(seq, keep)
            for layer in range(LAYOUT.layers):
                q = torch.randn(4, 1, LAYOUT.head_dim, generator=g)
                want = dense_reference(q, kept.k[layer], kept.v[layer])
                assert float((seq.attend(layer, q.cuda()).cpu().double() - want).abs().max()) < 1e-5
            twin.free()
        cache.check_invariants()
        seq.free()
        assert not cache.manager.held


def test_a_crop_keeps_the_exact_summaries_of_the_blocks_it_drops(tmp_path):
    """Second review: a crop released blocks without keeping their key summaries (free keeps
    them), so a later prompt reusing one rebuilt them from an INT4 copy."""
    g = torch.Generator().manual_seed(8)
    with _cache(tmp_path, hbm=1, dram=1, codec="int4") as cache:
        seq = cache.sequence(tokens=list(range(21)))
        _Kept().append(seq, 21, g)
        state = seq._layers[0]
        exact = {int(state.ids[row]): state.kmin[row].clone() for row in range(1, state.n)}
        cache._summaries.clear()
        seq.crop(4)
        assert all(torch.equal(cache._summaries[i][0], kmin) for i, kmin in exact.items())
        seq.free()
