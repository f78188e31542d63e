"""The drop-in ``transformers`` cache against what an adversarial probe found: KV stored under
content keys it does not deserve (other prompts, embeddings, images, other weights), arguments
the attention does not implement, passes that fail half-way, unbounded score matrices,
gradients, and inputs refused too late or with unclear errors. Each test failed before its fix.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the transformers cache needs the hf extra")

from test_hf_cache import BLOCK, VOCAB, generate, reference, store, tiered, tiny_llama  # noqa: E402

import tiercache.attention as attention  # noqa: E402
from tiercache import TieredKVCache  # noqa: E402
from tiercache.config import AttentionMode, TierConfig  # noqa: E402
from tiercache.errors import UserError  # noqa: E402
from tiercache.integrations.transformers import TieredCache, kv_layout, match_prefix, use_tiercache  # noqa: E402


def ids_of(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


# -- content keys only for KV the ids determine ------------------------------------------------
def test_generate_refuses_ids_that_differ_from_the_prompt_inside_the_reused_prefix(tmp_path):
    model = use_tiercache(tiny_llama(seed=1))
    first = ids_of(40, 2)
    other = first.clone()
    other[0, 5] = other[0, 5] % (VOCAB - 1) + 1
    with tiered(model, tmp_path) as kv:
        store(model, kv, first)
        cache = TieredCache(kv, model, prompt=first)
        assert cache.cached_tokens == 32
        with pytest.raises(UserError, match="differ from the prompt"):
            generate(model, other, cache)


def test_a_pass_of_embeddings_after_a_prompt_stores_private_kv(tmp_path):
    model = use_tiercache(tiny_llama(seed=3))
    ids = ids_of(33, 4)
    embeds = torch.randn(1, 33, 64, generator=torch.Generator().manual_seed(5))  # not embed(ids)
    want_tokens, want_logits = reference(model, ids)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        cache = TieredCache(kv, model, prompt=ids)
        with torch.no_grad():
            model(inputs_embeds=embeds, cache=cache)
        cache.free()
        assert match_prefix(kv, model, ids) == 0
        tokens, logits = generate(model, ids, TieredCache(kv, model, prompt=ids))
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() < 1e-5


def test_models_with_other_weights_never_share_kv(tmp_path):
    first, second = use_tiercache(tiny_llama(seed=6)), use_tiercache(tiny_llama(seed=7))
    ids = ids_of(40, 8)
    want_tokens, want_logits = reference(second, ids)
    with tiered(first, tmp_path) as kv:
        store(first, kv, ids)
        assert match_prefix(kv, first, ids) == 40 and match_prefix(kv, second, ids) == 0
        tokens, logits = generate(second, ids, TieredCache(kv, second))
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() < 1e-5


def tiny_llava():
    """A random-weight LLaVA (CLIP tower, 2-layer Llama); image token 120 (17 of them: 16 patches and CLS)."""
    torch.manual_seed(9)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                           image_size=16, patch_size=4, projection_dim=32)
    text = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=120,
                                      vision_feature_layer=-1, vision_feature_select_strategy="full")
    return transformers.LlavaForConditionalGeneration(config).eval()


def test_a_vision_language_model_keeps_each_images_kv_apart(tmp_path):
    model = tiny_llava()
    ids = torch.cat([ids_of(3, 10) % 100 + 1, torch.full((1, 17), 120), ids_of(12, 11) % 100 + 1], dim=1)
    images = [torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]

    def run(image, cache=None):
        kwargs = {} if cache is None else {"cache": cache}
        return model.generate(input_ids=ids, pixel_values=image, max_new_tokens=6, do_sample=False, pad_token_id=0, **kwargs)

    model.set_attn_implementation("sdpa")
    want = run(images[1])
    use_tiercache(model)
    assert model.config.vision_config._attn_implementation != "tiercache"  # only the language model switches
    with TieredKVCache(kv_layout(model.config, torch.float32, BLOCK), [TierConfig("hbm", 8), TierConfig("dram", 8)],
                       device="cpu") as kv:
        first = TieredCache(kv, model)
        run(images[0], first)
        first.free()
        assert match_prefix(kv, model, ids) == 0  # the image's KV is private
        got = run(images[1], TieredCache(kv, model))
    assert torch.equal(got, want)


# -- attention arguments it does not implement ---------------------------------------------------
def test_attention_sinks_are_refused_not_ignored(tmp_path):
    torch.manual_seed(12)
    config = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2, layer_types=["full_attention"] * 2, sliding_window=128)
    model = use_tiercache(transformers.GptOssForCausalLM(config).eval())
    with tiered(model, tmp_path) as kv, pytest.raises(UserError, match="s_aux"):
        generate(model, ids_of(10, 13), TieredCache(kv, model), new=2)


def test_a_sliding_window_works_until_the_sequence_outgrows_it(tmp_path):
    torch.manual_seed(14)
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=48)
    model = use_tiercache(transformers.MistralForCausalLM(config).eval())
    ids = ids_of(30, 15)
    want_tokens, _ = reference(model, ids, new=10)
    with tiered(model, tmp_path) as kv:
        tokens, _ = generate(model, ids, TieredCache(kv, model), new=10)
        with pytest.raises(UserError, match="sliding_window=48"):
            generate(model, ids, TieredCache(kv, model), new=30)
    assert torch.equal(tokens, want_tokens)


def test_attention_weights_are_refused(tmp_path):
    model = use_tiercache(tiny_llama())
    with tiered(model, tmp_path) as kv, pytest.raises(UserError, match="output_attentions"):
        model(ids_of(6, 16), cache=TieredCache(kv, model), output_attentions=True)


def test_a_backward_pass_through_the_attention_raises(tmp_path):
    model = use_tiercache(tiny_llama())
    with tiered(model, tmp_path) as kv:
        logits = model(ids_of(6, 17), cache=TieredCache(kv, model)).logits
        with pytest.raises(UserError, match="no gradient"):
            logits.sum().backward()


# -- a pass that fails half-way -----------------------------------------------------------------
def test_a_pass_refused_before_storing_leaves_the_cache_usable(tmp_path):
    model = use_tiercache(tiny_llama(seed=18))
    ids = ids_of(12, 19)
    want_tokens, _ = reference(model, ids)
    custom = torch.ones(1, 1, 12, 12, dtype=torch.bool)  # bidirectional: refused at layer 0
    with tiered(model, tmp_path) as kv:
        cache = TieredCache(kv, model, prompt=ids)
        with pytest.raises(UserError, match="not causal"):
            model(ids, attention_mask=custom, cache=cache)
        tokens, _ = generate(model, ids, cache)
    assert torch.equal(tokens, want_tokens)


def test_a_pass_that_fails_after_storing_some_layers_is_refused_until_freed(tmp_path):
    model = use_tiercache(tiny_llama(seed=20))
    ids = ids_of(12, 21)
    want_tokens, _ = reference(model, ids)

    def boom(module, args, kwargs):
        raise RuntimeError("out of memory in layer 1")

    with tiered(model, tmp_path) as kv:
        cache = TieredCache(kv, model)
        hook = model.model.layers[1].self_attn.register_forward_pre_hook(boom, with_kwargs=True)
        with pytest.raises(RuntimeError, match="layer 1"):
            model(ids, cache=cache)
        hook.remove()
        with pytest.raises(UserError, match="free"):
            generate(model, ids, cache)
        cache.free()
        tokens, _ = generate(model, ids, cache)
    assert torch.equal(tokens, want_tokens)


# -- bounded scores -----------------------------------------------------------------------------
def test_a_prefill_over_a_stored_prefix_scores_a_bounded_slice_at_a_time(tmp_path, monkeypatch):
    model = use_tiercache(tiny_llama(seed=22))
    first = ids_of(64, 23)
    second = torch.cat([first[:, :48], ids_of(40, 24)], dim=1)
    want_tokens, want_logits = reference(model, second)
    budget = 2048
    monkeypatch.setattr(attention, "SCORE_BUDGET", budget)
    monkeypatch.setattr("tiercache.integrations.causal.SCORE_BUDGET", budget)
    largest = []
    real = attention.partial_attention

    def spy(q, k, v, *args, **kwargs):
        largest.append(q.shape[0] * q.shape[1] * k.shape[1])
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention, "partial_attention", spy)
    monkeypatch.setattr("tiercache.integrations.causal.partial_attention", spy)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        store(model, kv, first, new=2)
        tokens, logits = generate(model, second, TieredCache(kv, model, prompt=second))
    assert max(largest) <= budget
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() < 1e-5


# -- inputs refused early and clearly -----------------------------------------------------------
def test_a_bad_budget_or_dtype_is_refused_by_the_constructor(tmp_path):
    model = use_tiercache(tiny_llama())
    with tiered(model, tmp_path) as kv:
        with pytest.raises(UserError, match="budget"):
            TieredCache(kv, model, AttentionMode.SPARSE, budget=0)
    with tiered(model, tmp_path / "b", dtype=torch.bfloat16) as kv, pytest.raises(UserError, match="computes in"):
        TieredCache(kv, model)


@pytest.mark.parametrize("prompt, message", [
    ([[1, 2, 3], [4, 5]], "differ in length"),
    ([], "n >= 1"),
    (np.zeros((1, 0), dtype=np.int64), "n >= 1"),
    (torch.tensor([1.5, 2.0]), "integers"),
    (np.ones((1, 2, 3), dtype=np.int64), "shape"),
])
def test_bad_prompts_are_named(tmp_path, prompt, message):
    model = use_tiercache(tiny_llama())
    with tiered(model, tmp_path) as kv, pytest.raises(UserError, match=message):
        TieredCache(kv, model, prompt=prompt)


def test_numpy_and_list_prompts_are_read(tmp_path):
    model = use_tiercache(tiny_llama(seed=25))
    ids = ids_of(20, 26)
    with tiered(model, tmp_path) as kv:
        store(model, kv, ids)
        for prompt in (ids.numpy(), ids[0].numpy(), ids[0].tolist(), ids.tolist()):
            cache = TieredCache(kv, model, prompt=prompt)
            assert cache.cached_tokens == 16
            cache.free()


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
    other = prompt.clone()
    other[0, 5] = other[0, 5] % (VOCAB - 1) + 1
    with tiered(model, tmp_path) as kv:
        store(model, kv, prompt)
        cache = TieredCache(kv, model, prompt=prompt)
        args, kwargs = ((other,), {}) if keyword is None else ((), {keyword: other})
        with pytest.raises(UserError, match="differ from the prompt"):
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


def test_freeing_the_cache_during_generation_is_refused(tmp_path):
    model = use_tiercache(tiny_llama(seed=7))

    class FreeAtFourth(transformers.StoppingCriteria):
        def __init__(self, cache):
            self.cache, self.calls = cache, 0

        def __call__(self, input_ids, scores, **kwargs):
            self.calls += 1
            if self.calls == 4:
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


def test_a_closed_store_and_several_returned_sequences_with_a_prompt_are_named(tmp_path):
    model = use_tiercache(tiny_llama(seed=59))
    ids = ids_of(12, 60)
    kv = tiered(model, tmp_path)
    cache = TieredCache(kv, model, prompt=ids)
    with pytest.raises(UserError, match="num_return_sequences"):
        model.generate(ids, cache=cache, num_return_sequences=2, do_sample=True, max_new_tokens=2, pad_token_id=0)
    kv.close()
    for _ in range(2):  # the first refusal and every later one name the closed store
        with pytest.raises(UserError, match="closed"), torch.no_grad():
            model(ids, cache=cache)
