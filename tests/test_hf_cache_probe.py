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


def one_changed(ids: torch.Tensor, position: int) -> torch.Tensor:
    """``ids`` with the id at ``position`` (of row 0) replaced by another valid id."""
    other = ids.clone()
    other[0, position] = other[0, position] % (VOCAB - 1) + 1
    return other


# -- content keys only for KV the ids determine ------------------------------------------------
def test_generate_refuses_ids_that_differ_from_the_prompt_inside_the_reused_prefix(tmp_path):
    model = use_tiercache(tiny_llama(seed=1))
    first = ids_of(40, 2)
    other = one_changed(first, 5)
    with tiered(model, tmp_path) as kv:
        store(model, kv, first)
        cache = TieredCache(kv, model, prompt=first)
        assert cache.cached_tokens == 32
        with pytest.raises(UserError, match="differ from the ids"):
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
        with pytest.raises(UserError, match="^TieredCache: a budget count must be at least one block"):
            TieredCache(kv, model, AttentionMode.SPARSE, budget=0)  # named TieredCache, not Sequence.attend
        with pytest.raises(UserError, match="^TieredCache: AttentionMode.SPARSE needs a budget"):
            TieredCache(kv, model, AttentionMode.SPARSE)
        with pytest.raises(UserError, match="^TieredCache: budget applies to AttentionMode.SPARSE only"):
            TieredCache(kv, model, AttentionMode.EXACT, budget=2)
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


def test_a_refused_continuation_says_what_the_cache_holds(tmp_path):
    """Probe Q68: a cache made without prompt= that refused a generate's ids told the user to
    give "the same ids as prompt=", which they never gave."""
    model = use_tiercache(tiny_llama(seed=68))
    prompt = ids_of(6, 69)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        cache = TieredCache(kv, model)
        out = model.generate(prompt, cache=cache, do_sample=False, max_new_tokens=6, pad_token_id=0)
        other = torch.cat([prompt, ids_of(14, 70)], dim=1)  # shares only the first 6 ids
        with pytest.raises(UserError, match=r"differ from the ids the cache holds \(its prompt and what generate "
                                            r"returned\) \(continue from the ids generate returned, or free"):
            model.generate(other, cache=cache, do_sample=False, max_new_tokens=2, pad_token_id=0)
        cache.free()
        made = TieredCache(kv, model, prompt=out)
        with pytest.raises(UserError, match=r"differ from the ids of the prompt the cache was made for \(prompt=\) "
                                            r"\(give generate the same ids as prompt="):
            model.generate(other, cache=made, do_sample=False, max_new_tokens=2, pad_token_id=0)
        made.free()


def test_a_readied_model_given_another_cache_is_refused_by_name_before_it_runs(tmp_path):
    """Probe Q68: ``past_key_values=DynamicCache()`` or ``cache_implementation="static"`` on a
    readied model was refused 32 frames deep, by a message that could not name either."""
    from transformers import DynamicCache, GenerationConfig

    model = use_tiercache(tiny_llama(seed=71))
    prompt = ids_of(6, 72)
    for given, named in ((dict(past_key_values=DynamicCache()), "past_key_values=DynamicCache"),
                         (dict(cache_implementation="static"), "cache_implementation='static'"),
                         (dict(generation_config=GenerationConfig(cache_implementation="dynamic", max_new_tokens=2)),
                          "cache_implementation='dynamic'"), (dict(use_cache=False), "use_cache=False"),
                         ({}, "no cache")):
        with pytest.raises(UserError, match=rf"pass cache=TieredCache\(kv, model\) \(the call gave {named}.*nothing was run"):
            model.generate(prompt, do_sample=False, pad_token_id=0, max_new_tokens=2, **given)
    with pytest.raises(UserError, match=r"the call gave cache_implementation='static'"):  # a config given second
        model.generate(prompt, GenerationConfig(cache_implementation="static", max_new_tokens=2, pad_token_id=0))
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:  # the readied model still generates with its cache
        cache = TieredCache(kv, model)
        assert model.generate(prompt, cache=cache, do_sample=False, max_new_tokens=2, pad_token_id=0).shape[1] == 8
        cache.free()
