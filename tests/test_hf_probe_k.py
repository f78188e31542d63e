"""The drop-in ``transformers`` cache against a fourth adversarial probe (K): a cache driven by a
model it was not made for, custom positions over a reused prefix, a one-token prompt pass in
sparse mode, caches dropped without ``free()``, positions starting past 0, decoding modes
refused only after passes had run, and copies of a cache. Each test failed before its fix.
"""

from __future__ import annotations

import copy
import gc
import pickle
import sys
import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="the transformers cache needs the hf extra")

from test_hf_cache import VOCAB, generate, reference, store, tiered, tiny_llama  # noqa: E402
from test_hf_cache_probe import ids_of  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiercache.config import AttentionMode  # noqa: E402
from tiercache.errors import UserError  # noqa: E402
from tiercache.integrations.transformers import TieredCache, match_prefix, use_tiercache  # noqa: E402


def sharp_llama(seed: int = 0) -> LlamaForCausalLM:
    """``tiny_llama`` with 10x larger initial weights: peaked attention, so that KV at other
    positions or a sparse read moves the logits far beyond float32 rounding."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, attn_implementation="sdpa")
    return use_tiercache(LlamaForCausalLM(config).eval())


# -- finding 1: a cache serves the model (and the weights) it was made for --------------------------
def test_a_pass_by_another_model_is_refused_before_it_stores_anything(tmp_path):
    model, other = use_tiercache(tiny_llama(seed=60)), use_tiercache(tiny_llama(seed=61))
    ids = ids_of(40, 62)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        cache = TieredCache(kv, model, prompt=ids)
        with pytest.raises(UserError, match="not the decoder of the model this cache was made for"):
            other.generate(ids, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert cache.get_seq_length() == 0 and match_prefix(kv, model, ids) == 0  # nothing stored under its keys
        tokens, _ = generate(model, ids, cache)  # the model it was made for still runs it
    assert torch.equal(tokens, reference(model, ids)[0])


def test_a_cache_made_before_use_tiercache_found_other_weights_is_refused(tmp_path):
    model = use_tiercache(tiny_llama(seed=63))
    original = copy.deepcopy(model)
    ids = ids_of(40, 64)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        cache = TieredCache(kv, model)
        with torch.no_grad():
            model.model.layers[0].self_attn.k_proj.weight.mul_(3.0)
        use_tiercache(model)  # readied again after changing the weights, as README says
        with pytest.raises(UserError, match="found other weights since this cache was made"):
            model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert match_prefix(kv, original, ids) == 0
        use_tiercache(model)  # the same weights again: the fingerprint, and the cache, still hold
        generate(model, ids, TieredCache(kv, model), new=2)


# -- finding 3 (probe's 4): custom positions over a reused prefix ---------------------------------
def test_custom_position_ids_over_a_reused_prefix_are_refused(tmp_path):
    model = sharp_llama(seed=65)
    ids = ids_of(40, 66)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        store(model, kv, ids, new=2)
        cache = TieredCache(kv, model, prompt=ids)
        assert cache.cached_tokens == 32
        with pytest.raises(UserError, match="custom position_ids over a reused prefix"):
            model.generate(ids, cache=cache, position_ids=torch.arange(40).unsqueeze(0) * 5, max_new_tokens=2,
                           do_sample=False, pad_token_id=0)
        standard = model.generate(ids, cache=cache, position_ids=torch.arange(40).unsqueeze(0), max_new_tokens=4,
                                  do_sample=False, pad_token_id=0)  # the standard positions, given, still reuse
    assert torch.equal(standard, reference(model, ids, new=4)[0])


# -- finding 4 (probe's 9): a pass is a decode step by what it is, not by its token count ----------
def test_a_fully_stored_prompts_one_token_pass_is_exact_in_sparse_mode(tmp_path):
    model = sharp_llama(seed=67)
    ids = ids_of(41, 68)  # 40 tokens = 5 whole blocks: prompt= leaves one token to compute
    _, want = reference(model, ids, new=1)
    with tiered(model, tmp_path, hbm=20, dram=20) as kv:
        store(model, kv, ids, new=2)
        cache = TieredCache(kv, model, AttentionMode.SPARSE, budget=1, prompt=ids)
        assert cache.cached_tokens == 40
        _, got = generate(model, ids, cache, new=1)
    assert (got - want).abs().max().item() < 1e-4


def test_a_chunked_prefills_one_token_last_chunk_is_exact_in_sparse_mode(tmp_path):
    model = sharp_llama(seed=69)
    ids = ids_of(33, 70)  # chunks of 16: the last one is a single token
    _, want = reference(model, ids, new=1)
    with tiered(model, tmp_path, hbm=20, dram=20) as kv:
        out = model.generate(ids, cache=TieredCache(kv, model, AttentionMode.SPARSE, budget=1), prefill_chunk_size=16,
                             max_new_tokens=1, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    assert (torch.stack(out.logits) - want).abs().max().item() < 1e-4


def test_sparse_decode_steps_still_read_only_their_budget_after_an_exact_prompt(tmp_path):
    model = use_tiercache(tiny_llama(seed=71))
    ids = ids_of(41, 72)
    with tiered(model, tmp_path, hbm=20, dram=20) as kv:
        store(model, kv, ids, new=2)
        cache = TieredCache(kv, model, AttentionMode.SPARSE, budget=2, prompt=ids)
        generate(model, ids, cache, new=4)
        sparse = [r for r in cache.sequences[0].reports if r.mode is AttentionMode.SPARSE]
    assert len(sparse) == 3 * 2 and all(r.selected == 2 for r in sparse)  # 3 decode steps x 2 layers


# -- finding 5 (probe's 11): a dropped cache releases its rows -------------------------------------
def test_caches_dropped_without_free_release_their_blocks(tmp_path):
    model = use_tiercache(tiny_llama(seed=73))
    with tiered(model, tmp_path, hbm=4, dram=6) as kv:
        for seed in range(4):
            model.generate(ids_of(44, seed), cache=TieredCache(kv, model), max_new_tokens=4, do_sample=False,
                           pad_token_id=0)  # dropped at once: no gc.collect() needed
            assert not kv.manager.held
        kv.check_invariants()


def test_a_cache_dropped_inside_a_store_call_is_released_at_the_next_safe_point(tmp_path):
    model = use_tiercache(tiny_llama(seed=74))
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        cache = TieredCache(kv, model)
        generate(model, ids_of(20, 75), cache, new=2)
        with kv.store._lock:  # as a cyclic collection inside one of the store's calls
            del cache
            gc.collect()
        assert kv.manager.held  # not released in the middle of a call
        TieredCache(kv, model)
        assert not kv.manager.held


def test_dropping_a_cache_after_its_store_closed_is_quiet(tmp_path, monkeypatch):
    model = use_tiercache(tiny_llama(seed=76))
    raised = []
    monkeypatch.setattr(sys, "unraisablehook", raised.append)
    kv = tiered(model, tmp_path)
    cache = TieredCache(kv, model)
    generate(model, ids_of(20, 77), cache, new=2)
    alive = weakref.ref(cache)
    kv.close()
    del cache
    assert alive() is None and not raised


# -- finding 8 (probe's 5): positions starting past 0 on a fresh cache ----------------------------
def test_position_ids_starting_past_zero_on_a_fresh_cache_generate_as_dynamic_cache(tmp_path):
    model = use_tiercache(tiny_llama(seed=78))
    ids, positions = ids_of(40, 79), torch.arange(40).unsqueeze(0) + 100
    model.set_attn_implementation("sdpa")
    want = model.generate(ids, position_ids=positions, max_new_tokens=6, do_sample=False, pad_token_id=0)
    use_tiercache(model)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        got = model.generate(ids, cache=TieredCache(kv, model), position_ids=positions, max_new_tokens=6,
                             do_sample=False, pad_token_id=0)
        assert match_prefix(kv, model, ids) == 0  # KV at other positions: private
    assert torch.equal(got, want)


# -- finding 9 (probe's 6): refused decoding modes run nothing ------------------------------------
@pytest.mark.parametrize("option", [{"prompt_lookup_num_tokens": 3}, {"num_beams": 2, "force_words_ids": [[5]]},
                                    {"penalty_alpha": 0.6, "top_k": 4}])
def test_decoding_modes_that_crop_or_reorder_are_refused_before_any_pass(tmp_path, option):
    model = use_tiercache(tiny_llama(seed=80))
    ids = ids_of(30, 81)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        cache = TieredCache(kv, model, prompt=ids)
        with pytest.raises(UserError, match="nothing was run and the cache is unchanged"):
            model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0, **option)
        assert cache.get_seq_length() == 0
        tokens, _ = generate(model, ids, cache, new=4)  # still usable
    assert torch.equal(tokens, reference(model, ids, new=4)[0])


# -- finding 11 (probe's 10): copies ------------------------------------------------------------
@pytest.mark.parametrize("duplicate", [copy.copy, pickle.dumps])
def test_a_cache_cannot_be_copied_and_says_what_to_do_instead(tmp_path, duplicate):
    """(A deep copy forks the rows: tests/test_fork.py.)"""
    model = use_tiercache(tiny_llama(seed=82))
    with tiered(model, tmp_path) as kv:
        cache = TieredCache(kv, model)
        generate(model, ids_of(20, 83), cache, new=2)
        with pytest.raises(UserError, match=r"cannot be shallow-copied.*prompt=ids"):
            duplicate(cache)
