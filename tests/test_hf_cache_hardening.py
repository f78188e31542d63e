"""The drop-in ``transformers`` cache against what a second and a third adversarial probe
found: every way into a pass (cache by position, the decoder called directly, ``generate``'s
argument spellings), inputs ``generate`` must refuse before computing, copies and pickles of a
readied model, a fingerprint that sees every value, models whose cache is not per-layer K and V,
and refusals that must name their cause. Each test failed before its fix.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the transformers cache needs the hf extra")

from test_hf_cache import BLOCK, VOCAB, generate, reference, store, tiered, tiny_llama  # noqa: E402
from test_hf_cache_probe import ids_of, one_changed  # noqa: E402

from tiercache import TieredKVCache  # noqa: E402
from tiercache.config import TierConfig  # noqa: E402
from tiercache.errors import UserError  # noqa: E402
from tiercache.integrations.transformers import TieredCache, kv_layout, match_prefix, use_tiercache  # noqa: E402


# -- a second probe: every way in, and content keys that must not be shared -----------------------
def test_a_cache_passed_by_position_or_to_the_decoder_goes_through_the_same_checks(tmp_path):
    model = use_tiercache(tiny_llama(seed=30))
    prompt = ids_of(40, 31)
    other = prompt.clone()
    other[0, 20:] = ids_of(20, 32)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv, torch.no_grad():
        with pytest.raises(UserError, match="differ from the prompt"):
            model(other, None, None, TieredCache(kv, model, prompt=prompt))
        with pytest.raises(UserError, match="differ from the prompt"):
            model.model(input_ids=other, cache=TieredCache(kv, model, prompt=prompt))
        assert match_prefix(kv, model, prompt) == 0


def test_a_pass_failing_half_way_with_a_positional_cache_is_refused_until_freed(tmp_path):
    model = use_tiercache(tiny_llama(seed=20))
    ids = ids_of(12, 21)

    def boom(module, args, kwargs):
        raise RuntimeError("out of memory in layer 1")

    with tiered(model, tmp_path) as kv, torch.no_grad():
        cache = TieredCache(kv, model)
        hook = model.model.layers[1].self_attn.register_forward_pre_hook(boom, with_kwargs=True)
        with pytest.raises(RuntimeError):
            model(ids, None, None, cache)
        hook.remove()
        with pytest.raises(UserError, match="free"):
            model(ids[:, -1:], None, None, cache)


@pytest.mark.parametrize("keyword", ["inputs", "input_ids", None])
def test_generate_checks_its_ids_however_they_are_given(tmp_path, keyword):
    model = use_tiercache(tiny_llama(seed=33))
    prompt = ids_of(40, 34)
    other = one_changed(prompt, 5)
    with tiered(model, tmp_path) as kv:
        store(model, kv, prompt)
        cache = TieredCache(kv, model, prompt=prompt)
        args, kwargs = ((other,), {}) if keyword is None else ((), {keyword: other})
        with pytest.raises(UserError, match="differ from the ids"):
            model.generate(*args, cache=cache, max_new_tokens=3, do_sample=False, pad_token_id=0, **kwargs)


def test_generate_refuses_embeddings_over_a_reused_prefix_and_ids_that_stop_inside_it(tmp_path):
    model = use_tiercache(tiny_llama(seed=35))
    prompt = ids_of(48, 36)
    with tiered(model, tmp_path) as kv:
        store(model, kv, prompt)
        cache = TieredCache(kv, model, prompt=prompt)
        assert cache.cached_tokens == 40
        embeds = torch.randn(1, 48, 64)
        with pytest.raises(UserError, match="inputs_embeds given with a reused prefix"):
            model.generate(input_ids=prompt, inputs_embeds=embeds, cache=cache, max_new_tokens=3, pad_token_id=0)
        with pytest.raises(UserError, match="reaching past the 40 positions"):
            model.generate(prompt[:, :40], cache=cache, max_new_tokens=3, pad_token_id=0)


@pytest.mark.parametrize("how", ["free", "free twice", "reset"])
def test_freeing_the_cache_during_generation_is_refused(tmp_path, how):
    """A second free (and reset, which frees once per layer) keeps the first one's mark
    (probe q48: it cleared it, and generation went on over an empty cache)."""
    model = use_tiercache(tiny_llama(seed=7))

    class FreeAtFourth(transformers.StoppingCriteria):
        def __init__(self, cache):
            self.cache, self.calls = cache, 0

        def __call__(self, input_ids, scores, **kwargs):
            self.calls += 1
            if self.calls == 4:
                if how == "reset":
                    self.cache.reset()
                else:
                    for _ in range(how.count(" ") + 1):
                        self.cache.free()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        cache = TieredCache(kv, model)
        with pytest.raises(UserError, match="freed during generation"):
            model.generate(ids_of(45, 8), cache=cache, max_new_tokens=12, do_sample=False, pad_token_id=0,
                           stopping_criteria=transformers.StoppingCriteriaList([FreeAtFourth(cache)]))


def test_a_deep_copy_checks_itself_and_a_pickled_model_must_be_readied_again(tmp_path):
    import copy
    import io

    original = use_tiercache(tiny_llama(seed=37))
    dup = copy.deepcopy(original)
    with torch.no_grad():
        dup.model.embed_tokens.weight.mul_(1.5)
    use_tiercache(dup)
    ids = ids_of(20, 38)
    want_tokens, _ = reference(dup, ids)
    with tiered(original, tmp_path) as kv:
        store(original, kv, ids)
        assert match_prefix(kv, dup, ids) == 0  # other weights, other keys
        tokens, _ = generate(dup, ids, TieredCache(kv, dup, prompt=ids))
        buffer = io.BytesIO()
        torch.save(original, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        with pytest.raises(UserError, match="use_tiercache"):
            TieredCache(kv, loaded)
        assert TieredCache(kv, use_tiercache(loaded)) is not None
    assert torch.equal(tokens, want_tokens)


def test_the_fingerprint_sees_the_config_and_every_weight():
    from tiercache.integrations.inputs import model_fingerprint

    model = tiny_llama(seed=39)
    before = model_fingerprint(model)
    with torch.no_grad():
        model.model.embed_tokens.weight[97, 3] += 1e-3  # one value of one row
    edited = model_fingerprint(model)
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_theta": 500.0}
    assert len({before, edited, model_fingerprint(model)}) == 3
    assert model_fingerprint(tiny_llama(seed=39)) == before  # the same weights: the same bytes


def test_bidirectional_attention_is_refused(tmp_path):
    torch.manual_seed(40)
    config = transformers.GemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      use_bidirectional_attention=True)
    model = use_tiercache(transformers.GemmaForCausalLM(config).eval())
    with tiered(model, tmp_path) as kv, pytest.raises(UserError, match="not causal"):
        model(ids_of(8, 41), cache=TieredCache(kv, model))


def test_a_pass_without_the_mask_after_padding_is_refused(tmp_path):
    model = use_tiercache(tiny_llama(seed=42))
    ids = ids_of(20, 43, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with tiered(model, tmp_path, hbm=8, dram=8) as kv, torch.no_grad():
        cache = TieredCache(kv, model)
        model(ids, attention_mask=mask, cache=cache)
        with pytest.raises(UserError, match="needs the attention mask"):
            model(ids_of(1, 44, batch=2), cache=cache)


def test_chunked_prefill_of_a_padded_batch_matches_dynamic_cache(tmp_path):
    model = use_tiercache(tiny_llama(seed=45))
    model.generation_config.eos_token_id = None
    ids = ids_of(30, 46, batch=2)
    mask = torch.ones_like(ids)
    ids[1, :20], mask[1, :20] = 0, 0  # row 1's first chunk of 16 is all padding
    options = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    want = model.generate(ids, **options)
    use_tiercache(model)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        got = model.generate(ids, cache=TieredCache(kv, model, prompt=ids, attention_mask=mask), prefill_chunk_size=16,
                             **options)
    assert torch.equal(got, want)


def test_latent_caches_and_unreadied_models_are_refused_clearly(tmp_path):
    config = transformers.DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                           q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                           v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                           first_k_dense_replace=1, n_group=1, topk_group=1)
    with pytest.raises(UserError, match="latent"):
        use_tiercache(transformers.DeepseekV3ForCausalLM(config).eval())
    model = use_tiercache(tiny_llama())
    with tiered(model, tmp_path) as kv, pytest.raises(UserError, match="use_tiercache"):
        match_prefix(kv, tiny_llama(seed=1), [1, 2, 3])


def test_a_first_pass_refused_before_storing_leaves_room_for_another_batch(tmp_path):
    model = use_tiercache(tiny_llama(seed=47))
    with tiered(model, tmp_path) as kv, torch.no_grad():
        cache = TieredCache(kv, model)
        with pytest.raises(UserError, match="not causal"):
            model(ids_of(6, 48, batch=2), attention_mask=torch.ones(2, 1, 6, 6, dtype=torch.bool), cache=cache)
        model(ids_of(6, 49), cache=cache)
        assert len(cache.sequences) == 1 and cache.seq_length(0) == 6


# -- a third probe ------------------------------------------------------------------------------
def test_the_fingerprint_sees_values_moved_between_chunks():
    from tiercache.integrations.inputs import model_fingerprint

    torch.manual_seed(50)
    config = transformers.LlamaConfig(vocab_size=32768, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    before = model_fingerprint(model)
    with torch.no_grad():  # the embedding's two 2**20-value halves trade places
        weight = model.model.embed_tokens.weight
        weight.copy_(torch.cat([weight[16384:], weight[:16384]]))
    assert model_fingerprint(model) != before


def test_a_model_in_training_mode_is_refused(tmp_path):
    model = use_tiercache(tiny_llama(seed=51)).train()
    with tiered(model, tmp_path) as kv, torch.no_grad(), pytest.raises(UserError, match="training mode"):
        model(ids_of(10, 52), cache=TieredCache(kv, model))


def test_a_namespace_must_be_str_or_bytes(tmp_path):
    model = use_tiercache(tiny_llama())
    with tiered(model, tmp_path) as kv:
        with pytest.raises(UserError, match="namespace must be str or bytes"):
            TieredCache(kv, model, namespace=0)
        with pytest.raises(UserError, match="namespace must be str or bytes"):
            match_prefix(kv, model, [1, 2, 3], namespace=3)
        assert TieredCache(kv, model, namespace="a").namespace == TieredCache(kv, model, namespace=b"a").namespace


def test_generate_refuses_ids_shorter_than_the_prompt_before_computing(tmp_path):
    model = use_tiercache(tiny_llama(seed=53))
    ids = ids_of(40, 54)
    with tiered(model, tmp_path) as kv:
        cache = TieredCache(kv, model, prompt=ids)
        with pytest.raises(UserError, match="fewer than"):
            generate(model, ids[:, :36], cache)
        assert cache.seq_length(0) == 0


@pytest.mark.parametrize("config, message", [
    (lambda: transformers.BartConfig(), "encoder-decoder"),
    (lambda: transformers.Gemma3nTextConfig(), "shares KV"),
    (lambda: transformers.JambaConfig(), "without attention KV"),
])
def test_models_whose_cache_is_not_per_layer_kv_are_refused(config, message):
    from tiercache.integrations.inputs import check_supported

    with pytest.raises(UserError, match=message):
        check_supported(config())


def test_classifier_free_guidance_is_refused_before_anything_runs(tmp_path):
    model = use_tiercache(tiny_llama(seed=55))
    ids = ids_of(20, 56)
    with tiered(model, tmp_path) as kv:
        cache = TieredCache(kv, model, prompt=ids)
        with pytest.raises(UserError, match="guidance_scale"):
            model.generate(ids, cache=cache, guidance_scale=1.5, max_new_tokens=3, pad_token_id=0)
        assert cache.seq_length(0) == 0


def test_blocks_another_sequence_holds_need_no_room(tmp_path):
    model = use_tiercache(tiny_llama(seed=57))
    ids = ids_of(25, 58)
    tiers = [TierConfig("hbm", 3), TierConfig("dram", 3)]  # 6 per-layer blocks: one 24-token prompt's
    with TieredKVCache(kv_layout(model.config, torch.float32, BLOCK), tiers, device="cpu") as kv, torch.no_grad():
        first, second = TieredCache(kv, model, prompt=ids), TieredCache(kv, model, prompt=ids)
        want = model(ids, cache=first).logits
        got = model(ids, cache=second).logits  # the same content-keyed blocks: held twice, stored once
        assert len(kv.manager.held) == 6
    assert (got - want).abs().max().item() < 1e-6


def test_a_closed_store_is_named(tmp_path):
    """(Several returned sequences with a prompt fork its rows: tests/test_hf_beams.py.)"""
    model = use_tiercache(tiny_llama(seed=59))
    ids = ids_of(12, 60)
    kv = tiered(model, tmp_path)
    cache = TieredCache(kv, model, prompt=ids)
    kv.close()
    for _ in range(2):  # the first refusal and every later one name the closed store
        with pytest.raises(UserError, match="closed"), torch.no_grad():
            model(ids, cache=cache)


def test_a_pass_refused_for_room_before_storing_leaves_the_cache_usable(tmp_path):
    model = use_tiercache(tiny_llama(seed=61))
    ids = ids_of(40, 62)
    want_tokens, _ = reference(model, ids[:, :12], new=3)
    tiers = [TierConfig("hbm", 2), TierConfig("dram", 2)]  # 4 per-layer blocks: 2 blocks of 8 per layer
    with TieredKVCache(kv_layout(model.config, torch.float32, BLOCK), tiers, device="cpu") as kv:
        cache = TieredCache(kv, model)
        with torch.no_grad(), pytest.raises(UserError, match="do not fit"):
            model(ids, cache=cache)
        tokens, _ = generate(model, ids[:, :12], cache, new=3)
    assert torch.equal(tokens, want_tokens)


# -- a fourth probe: appends that fail half-way -------------------------------------------------
def dense_logits(model, ids):
    """Prefill logits of ``ids`` with transformers' DynamicCache and SDPA."""
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            return model(ids, cache=transformers.DynamicCache(config=model.config)).logits
    finally:
        use_tiercache(model)


@pytest.mark.parametrize("failure", [OSError("write failed"), KeyboardInterrupt()], ids=["oserror", "interrupt"])
def test_a_store_failing_inside_an_append_leaves_the_sequence_as_it_was(tmp_path, monkeypatch, failure):
    """A block-aligned pass after a partial tail: a failed store at layer 0 used to overwrite
    the tail first, so the retry attended over the failed chunk's tokens."""
    model = use_tiercache(tiny_llama(seed=63))
    ids = ids_of(40, 64)
    want = dense_logits(model, ids)
    with tiered(model, tmp_path) as kv, torch.no_grad():
        cache = TieredCache(kv, model)
        model(ids[:, :11], cache=cache)  # one block and a 3-token tail per layer
        real, calls = kv.driver.write, []

        def failing_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise failure
            return real(*args, **kwargs)

        monkeypatch.setattr(kv.driver, "write", failing_once)
        with pytest.raises(type(failure)):
            model(ids[:, 11:19], cache=cache)  # 8 new tokens: exactly one block to store
        monkeypatch.undo()
        got = torch.cat([model(ids[:, 11:19], cache=cache).logits, model(ids[:, 19:30], cache=cache).logits], dim=1)
    assert (got - want[:, 11:30]).abs().max().item() < 1e-5


def test_an_interrupt_after_a_block_is_held_leaves_no_hold_behind(tmp_path, monkeypatch):
    from tiercache.live.sequence import Sequence

    model = use_tiercache(tiny_llama(seed=65))
    ids = ids_of(40, 66)
    with tiered(model, tmp_path) as kv, torch.no_grad():
        cache = TieredCache(kv, model)
        model(ids[:, :11], cache=cache)

        def interrupted(self, first, layer, block_ids):
            raise KeyboardInterrupt

        monkeypatch.setattr(Sequence, "_keep_tokens", interrupted)
        with pytest.raises(KeyboardInterrupt):
            model(ids[:, 11:19], cache=cache)
        monkeypatch.undo()
        cache.free()
        assert not any(kv.manager.held.values())
        kv.check_invariants()


def test_a_pass_that_feeds_held_positions_again_is_refused(tmp_path):
    model = use_tiercache(tiny_llama(seed=67))
    ids = ids_of(20, 68)
    with tiered(model, tmp_path) as kv:
        cache = TieredCache(kv, model)
        with torch.no_grad():
            model(ids, cache=cache)
            # (generate's use_cache=False, which did this, is refused before any pass: test_hf_probe_cr3.py)
            with pytest.raises(UserError, match="inside the 20 positions the cache holds"):
                model(ids, cache=cache, position_ids=torch.arange(20).unsqueeze(0))
