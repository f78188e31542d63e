"""The drop-in ``transformers`` cache against probe Q9's model families (tiny random configs,
CPU, nothing downloaded; a family this transformers lacks is skipped): a model whose attention
reads other K or V than its cache update returned (DiffLlama's two calls over halves of V,
JetMoE's repeated K and V) is refused at ``use_tiercache``, and, when not recognised there, by
the attention before anything is stored, naming which it is; unequal K and V head sizes
(MiMo-V2-Flash's ``v_head_dim``) and a per-layer ``head_dim`` (Gemma 4) are ``UserError``s of
``use_tiercache`` and ``kv_layout``; the attention's output is contiguous (AfMoE views it); a
config whose ``num_key_value_heads`` the model ignores (GPTBigCode) is named. Each test of a
finding failed before its fix; three guard against refusing more than the findings (equal
MiMo head sizes and GPTBigCode with the heads it uses still run; Falcon is still refused for
having no AttentionInterface).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the transformers cache needs the hf extra")

from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM  # noqa: E402

from tiercache import TieredKVCache  # noqa: E402
from tiercache.config import TierConfig  # noqa: E402
from tiercache.errors import UserError  # noqa: E402
from tiercache.integrations import inputs  # noqa: E402
from tiercache.integrations import transformers as tiered_transformers  # noqa: E402
from tiercache.integrations.transformers import TieredCache, kv_layout, tiercache_attention, use_tiercache  # noqa: E402

BLOCK = 16
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def tiny_config(family: str, **fields):
    """A tiny config of ``family`` (``TINY`` with ``fields``; a None field is left out);
    skips the test when this transformers has no such family."""
    if family not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {family} config")
    given = {name: value for name, value in {**TINY, **fields}.items() if value is not None}
    return AutoConfig.for_model(family, **given)


def tiny_model(family: str, **fields):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family, **fields)).eval()


def tiered(model, tmp_path) -> TieredKVCache:
    """A 4-block HBM tier spilling to NVMe."""
    tiers = [TierConfig("hbm", 4), TierConfig("nvme", 256)]
    return TieredKVCache(kv_layout(model.config, torch.float32, BLOCK), tiers, path=tmp_path / "nvme", device="cpu")


def ids_of(count: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (1, count), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, cache=None, new: int = 4) -> torch.Tensor:
    kwargs = {} if cache is None else {"cache": cache}
    return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)


def held(kv) -> int:
    return sum(kv.manager.held.values())


def refused_twice_storing_nothing(model, kv, match: str) -> None:
    """A generate through a new TieredCache is refused naming ``match``, stores nothing, and
    leaves the cache in step: the same generate is refused for the same reason, not as broken."""
    cache = TieredCache(kv, model)
    ids = ids_of(40, 1)
    for _ in range(2):
        with pytest.raises(UserError, match=match):
            greedy(model, ids, cache)
        assert cache.seq_length() == 0 and held(kv) == 0
    kv.check_invariants()


# -- finding 1: DiffLlama attends over halves of V, twice per layer -------------------------------
def test_diffllama_is_refused_at_use_tiercache_naming_its_two_attention_calls():
    model = tiny_model("diffllama")
    with pytest.raises(UserError, match=r"diffllama calls the attention twice per layer"):
        use_tiercache(model)


def test_a_v_other_than_the_staged_one_is_refused_by_the_attention_before_it_stores(tmp_path, monkeypatch):
    monkeypatch.setattr(inputs, "_KV_AFTER_UPDATE", {}, raising=False)  # as a model use_tiercache does not know
    model = use_tiercache(tiny_model("diffllama"))
    with tiered(model, tmp_path) as kv:  # before: a bare TypeError in the second call, the cache broken
        refused_twice_storing_nothing(model, kv, r"DiffLlamaAttention \(layer 0\) gave the attention another V")


# -- finding 5: JetMoE repeats K and V after the cache update -------------------------------------
def test_jetmoe_is_refused_at_use_tiercache_naming_the_repeated_kv():
    model = tiny_model("jetmoe", num_key_value_heads=None)
    with pytest.raises(UserError, match=r"jetmoe repeats K and V after the cache update"):
        use_tiercache(model)


def test_a_k_other_than_the_staged_one_is_named_not_taken_for_a_missing_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(inputs, "_KV_AFTER_UPDATE", {}, raising=False)
    model = use_tiercache(tiny_model("jetmoe", num_key_value_heads=None))
    with tiered(model, tmp_path) as kv:  # before: "this forward pass was given none (no TieredCache)"
        refused_twice_storing_nothing(model, kv, r"JetMoeAttention \(layer 0\) gave the attention another K")
    with pytest.raises(UserError, match=r"no TieredCache staged this layer's KV"):  # a pass truly without one
        with torch.no_grad():
            model(ids_of(20, 2))
    with pytest.raises(UserError, match=r"the call gave no cache"):  # a generate without one: refused before it runs
        greedy(model, ids_of(20, 2))


# -- finding 2: MiMo-V2-Flash's V heads are narrower than its K heads -----------------------------
MIMO = dict(head_dim=16, layer_types=["full_attention"] * 2, mlp_layer_types=["dense"] * 2)


def test_unequal_k_and_v_head_sizes_are_refused_by_use_tiercache_and_kv_layout():
    model = tiny_model("mimo_v2_flash", v_head_dim=8, **MIMO)
    with pytest.raises(UserError, match=r"V heads are 8 wide and its K heads 16 \(v_head_dim != head_dim\)"):
        use_tiercache(model)
    with pytest.raises(UserError, match=r"^kv_layout: .*v_head_dim != head_dim"):
        kv_layout(model.config, torch.float32, BLOCK)


def test_equal_k_and_v_head_sizes_still_run(tmp_path):
    model = tiny_model("mimo_v2_flash", v_head_dim=16, **MIMO)
    ids = ids_of(40, 3)
    want = greedy(model, ids)
    use_tiercache(model)
    with tiered(model, tmp_path) as kv:
        assert kv.layout.head_dim == 16
        assert torch.equal(greedy(model, ids, TieredCache(kv, model)), want)


# -- finding 3: AfMoE views the attention output ---------------------------------------------------
def test_afmoe_generates_the_dynamic_cache_tokens(tmp_path):
    model = tiny_model("afmoe")
    ids = ids_of(40, 4)
    want = greedy(model, ids)
    use_tiercache(model)
    with tiered(model, tmp_path) as kv:  # before: RuntimeError "view size is not compatible" in transformers
        assert torch.equal(greedy(model, ids, TieredCache(kv, model)), want)


def test_the_attention_output_is_contiguous_as_transformers_own(tmp_path):
    model = use_tiercache(tiny_model("llama"))
    with tiered(model, tmp_path) as kv, torch.no_grad():
        cache = TieredCache(kv, model)
        model(ids_of(20, 5), cache=cache)  # a prompt held, so the next pass merges held and new tokens
        layer = model.model.layers[0].self_attn
        query = torch.randn(1, 4, 3, 16)
        key, value = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
        cache.begin_pass(model.model, None, {"inputs_embeds": torch.zeros(1, 3, 64)})
        key, value = cache.update(key, value, 0)
        out, _ = tiercache_attention(layer, query, key, value, None, scaling=0.25)
        assert out.shape == (1, 3, 4, 16) and out.is_contiguous()


# -- finding 4: Gemma 4's head_dim is per layer ------------------------------------------------------
def test_a_per_layer_head_dim_is_a_user_error_of_kv_layout_and_use_tiercache():
    config = tiny_config("gemma4_text", head_dim=16)
    with pytest.raises(UserError, match=r"^kv_layout: gemma4_text's config cannot give head_dim"):
        kv_layout(config, torch.float32, BLOCK)
    torch.manual_seed(0)
    with pytest.raises(UserError, match=r"^use_tiercache: gemma4_text's config cannot give head_dim"):
        use_tiercache(AutoModelForCausalLM.from_config(config).eval())


# -- finding 6: GPTBigCode ignores config.num_key_value_heads ----------------------------------------
def bigcode():
    """GPTBigCodeConfig(num_attention_heads=4, multi_query=False) says 12 KV heads; its layers use 4."""
    model = tiny_model("gpt_bigcode", num_key_value_heads=None, multi_query=False)
    assert model.config.num_key_value_heads == 12  # the quirk this guards against
    return model


def test_kv_heads_the_model_does_not_use_are_named_at_use_tiercache():
    model = bigcode()
    before = model.config._attn_implementation
    with pytest.raises(UserError, match=r"layer 0 of gpt_bigcode uses 4 KV heads, but the config says "
                                        r"num_key_value_heads=12 .*set config.num_key_value_heads=4"):
        use_tiercache(model)
    assert model.config._attn_implementation == before != "tiercache"  # refused: the model is left as it was


def test_kv_heads_that_differ_from_layer_to_layer_are_named_at_use_tiercache():
    model = tiny_model("mimo_v2_flash", v_head_dim=16, head_dim=16, sliding_window=4096,
                       layer_types=["full_attention", "sliding_attention"], mlp_layer_types=["dense"] * 2)
    with pytest.raises(UserError, match=r"mimo_v2_flash's layers use different numbers of KV heads "
                                        r"\(layer 0: 2, layer 1: 4\)"):  # its sliding layers double them
        use_tiercache(model)


def test_a_model_without_attention_interface_is_still_refused_for_that_first(tmp_path):
    """Falcon (its layers use 1 KV head, its config says none) had no AttentionInterface up to
    transformers 5.24: refused for that first. From 5.25 it switches: then it must decode what
    it decodes without tiercache (the `hf` extra allows both)."""
    model = tiny_model("falcon", num_key_value_heads=None)
    ids = ids_of(40, 6)
    want = greedy(model, ids)
    try:
        use_tiercache(model)
    except UserError as refused:
        assert "cannot switch its attention implementation" in str(refused)
        return
    with tiered(model, tmp_path) as kv:
        assert kv.layout.kv_heads == 1
        assert torch.equal(greedy(model, ids, TieredCache(kv, model)), want)


def test_the_heads_the_model_uses_run_once_the_config_says_them(tmp_path):
    model = bigcode()
    ids = ids_of(40, 6)
    want = greedy(model, ids)
    model.config.num_key_value_heads = 4  # as the refusal advises
    use_tiercache(model)
    with tiered(model, tmp_path) as kv:
        assert kv.layout.kv_heads == 4
        assert torch.equal(greedy(model, ids, TieredCache(kv, model)), want)


def test_kv_of_another_shape_than_the_layout_is_refused_at_the_update_naming_the_layout(tmp_path, monkeypatch):
    monkeypatch.setattr(tiered_transformers, "check_kv_heads", lambda model: None, raising=False)
    model = use_tiercache(bigcode())  # as a model whose layers do not say their KV heads
    with tiered(model, tmp_path) as kv:  # before: "Sequence.append: k must be [kv_heads=12, ...]"
        refused_twice_storing_nothing(model, kv, r"layer 0 gives K of shape \(1, 4, 40, 16\) .*kv_heads=12, "
                                                 r"tokens, head_dim=16\].*num_key_value_heads")


# -- probe Q56: Dory copies a layer's cache per loop -----------------------------------------------
def test_a_looped_model_copying_a_layers_cache_is_refused_storing_nothing(tmp_path):
    """Dory (per-loop KV) deep-copies its recurrent layers' cache entries once per loop; the
    copy staged into the same TieredCache layer, so the second loop attended over the first
    loop's KV as its own: wrong logits with no error, layers of unequal lengths stored."""
    model = tiny_model("dory", num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1,
                       n_recurrent_loops=2, recurrent_kv_cache_mode="per_loop", max_position_embeddings=None,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)
    use_tiercache(model)
    kv = tiered(model, tmp_path)
    refused_twice_storing_nothing(model, kv, "copied layer 1 of its cache on its own")
    kv.close()
