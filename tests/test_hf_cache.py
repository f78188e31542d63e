"""The drop-in ``transformers`` cache (``tiercache.integrations.transformers``).

Tiered-vs-dense equivalence: a tiny random-weight Llama (GQA) generates the same greedy tokens,
with logits within float32 rounding, through a ``TieredCache`` whose KV spills from a 4-block
HBM tier to DRAM and NVMe as through transformers' own ``DynamicCache``; in float64 the logits
agree to 1e-10. The attention alone is checked against a float64 causal reference on fresh random
inputs. Exact-id scenarios: a second prompt reuses exactly the stored whole blocks of its shared
prefix. Fault injection: a corrupt NVMe chunk read during generation raises instead of
attending over the rest. Every limit raises a ``UserError`` naming it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="the transformers cache needs the hf extra (pip install -e '.[hf]')")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiercache import TieredKVCache  # noqa: E402
from tiercache.config import AttentionMode, TierConfig  # noqa: E402
from tiercache.errors import UserError  # noqa: E402
from tiercache.integrations.transformers import (  # noqa: E402
    TieredCache, kv_layout, match_prefix, tiercache_attention, use_tiercache)

BLOCK = 8
VOCAB = 128


def tiny_llama(seed: int = 0, dtype=torch.float32, attn: str = "sdpa") -> LlamaForCausalLM:
    """A 2-layer random-weight Llama with grouped-query attention (4 query heads, 2 KV heads)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         attn_implementation=attn)
    return LlamaForCausalLM(config).to(dtype).eval()


def tiered(model, tmp_path, dtype=torch.float32, hbm: int = 4, dram: int = 6, **options) -> TieredKVCache:
    """A tiered cache for ``model`` small enough that a 60-token sequence spills to NVMe."""
    tiers = [TierConfig("hbm", hbm), TierConfig("dram", dram), TierConfig("nvme", 200)]
    return TieredKVCache(kv_layout(model.config, dtype, BLOCK), tiers, path=tmp_path / "nvme", device="cpu", **options)


def generate(model, ids, cache=None, new: int = 12):
    """Greedy generation of exactly ``new`` tokens (no early EOS: every step is compared);
    returns (tokens, logits per step as one tensor)."""
    kwargs = {} if cache is None else {"cache": cache}
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, **kwargs)
    return out.sequences, torch.stack(out.logits)


def store(model, kv, ids, new: int = 12) -> torch.Tensor:
    """Generates from ``ids`` through a TieredCache and frees it (its blocks stay stored);
    returns the tokens."""
    cache = TieredCache(kv, model, prompt=ids)
    tokens, _ = generate(model, ids, cache, new)
    cache.free()
    return tokens


def generate_reusing(model, kv, ids, cached: int, new: int = 12):
    """Generates from ``ids`` through a new TieredCache after checking that it reuses
    exactly ``cached`` stored tokens; returns (tokens, logits)."""
    cache = TieredCache(kv, model, prompt=ids)
    assert cache.cached_tokens == cached
    return generate(model, ids, cache, new)


def reference(model, ids, new: int = 12):
    """The same generation with transformers' DynamicCache and SDPA attention."""
    model.set_attn_implementation("sdpa")
    try:
        return generate(model, ids, new=new)
    finally:
        use_tiercache(model)


# -- tiered vs dense ------------------------------------------------------------------------
def test_generate_matches_dynamic_cache_while_kv_spills_to_nvme(tmp_path):
    model = tiny_llama()
    ids = torch.randint(1, VOCAB, (1, 45), generator=torch.Generator().manual_seed(1))
    want_tokens, want_logits = reference(model, ids, new=16)
    use_tiercache(model)
    with tiered(model, tmp_path) as kv:
        cache = TieredCache(kv, model)
        tokens, logits = generate(model, ids, cache, new=16)
        stats = kv.stats()
        assert cache.seq_length(0) == 45 + 16 - 1  # the last token's KV is never computed
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() < 1e-5
    nvme = stats["tiers"][2]
    assert nvme["hits"] > 0, "the KV never left HBM and DRAM: the test would not exercise the tiers"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_generate_on_cuda_matches_dynamic_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = tiny_llama(seed=27).cuda()
    ids = torch.randint(1, VOCAB, (1, 45), generator=torch.Generator().manual_seed(28)).cuda()
    want_tokens, want_logits = reference(model, ids, new=16)
    tiers = [TierConfig("hbm", 4), TierConfig("dram", 6), TierConfig("nvme", 200)]
    with TieredKVCache(kv_layout(model.config, torch.float32, BLOCK), tiers, path=tmp_path / "nvme") as kv:
        assert kv.device.type == "cuda"
        tokens, logits = generate(model, ids, TieredCache(kv, model), new=16)
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() < 1e-4


def test_float64_forward_agrees_with_sdpa_to_1e10(tmp_path):
    """Prefill then single-token steps in float64 (generate would hand back float32 logits;
    eager attention takes its softmax in float32, SDPA stays in float64)."""
    model = tiny_llama(seed=3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (1, 37), generator=gen)
    steps = torch.randint(1, VOCAB, (1, 8), generator=gen)

    def run(cache):
        logits = [model(ids, cache=cache).logits[:, -1]]
        logits += [model(steps[:, i : i + 1], cache=cache).logits[:, -1] for i in range(steps.shape[1])]
        return torch.cat(logits)

    from transformers import DynamicCache
    with torch.no_grad():
        want = run(DynamicCache(config=model.config))
        use_tiercache(model)
        with tiered(model, tmp_path, dtype=torch.float64) as kv:
            got = run(TieredCache(kv, model))
    assert got.dtype == torch.float64
    assert (got - want).abs().max().item() < 1e-10


def test_unpadded_batch_matches_dynamic_cache(tmp_path):
    model = tiny_llama(seed=5)
    ids = torch.randint(1, VOCAB, (2, 30), generator=torch.Generator().manual_seed(6))
    want_tokens, want_logits = reference(model, ids)
    with tiered(model, tmp_path, hbm=6, dram=8) as kv:
        tokens, logits = generate(model, ids, TieredCache(kv, model))
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() < 1e-5


@pytest.mark.parametrize("seed", range(4))
def test_attention_matches_float64_causal_reference(tmp_path, seed):
    """The attention over a held prefix (in every tier) plus a causal chunk of new tokens."""
    gen = torch.Generator().manual_seed(seed)
    model = use_tiercache(tiny_llama())
    held, new, heads, kv_heads, dim = 29 + seed * 7, 5 + seed * 9, 4, 2, 16
    k = torch.randn(1, kv_heads, held + new, dim, generator=gen) * 3
    v = torch.randn(1, kv_heads, held + new, dim, generator=gen)
    q = torch.randn(1, heads, new, dim, generator=gen) * 3
    with tiered(model, tmp_path, hbm=2, dram=2) as kv:
        out = attend_after(TieredCache(kv, model), model, q, k, v, held)
    assert out.shape == (1, new, heads, dim)
    want = causal_reference(q[0], k[0], v[0], held)
    assert torch.allclose(out[0].transpose(0, 1).double(), want, rtol=1e-5, atol=1e-5)


def attend_after(cache, model, q, k, v, held: int, scaling: float | None = None):
    """The tiercache attention of layer 0 for queries ``q`` over the new keys ``k[:, :, held:]``
    after a pass that held ``k[:, :, :held]`` at every layer (appended as they are)."""
    if held:  # passes of embeddings, not ids: private keys
        cache.begin_pass(model.model, None, {"inputs_embeds": torch.zeros(1, held, 64)})
        for layer in range(2):
            cache.sequences[0].append(layer, k[0, :, :held], v[0, :, :held])
        cache.end_pass()
    cache.begin_pass(model.model, None, {"inputs_embeds": torch.zeros(1, q.shape[2], 64)})
    key, value = cache.update(k[:, :, held:], v[:, :, held:], 0)
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    return tiercache_attention(model.model.layers[0].self_attn, q, key, value, None, scaling=scaling)[0]


def causal_reference(q, k, v, held):
    """float64 attention of ``q`` [heads, t, D]: query i sees keys [0, held + i]."""
    heads, tokens, dim = q.shape
    group = heads // k.shape[0]
    kk = k.double().repeat_interleave(group, 0)
    vv = v.double().repeat_interleave(group, 0)
    scores = q.double() @ kk.transpose(1, 2) / math.sqrt(dim)
    mask = torch.ones(tokens, held + tokens, dtype=torch.bool).tril(held)
    return torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1) @ vv


def test_scaling_other_than_one_over_sqrt_d_is_applied(tmp_path):
    gen = torch.Generator().manual_seed(9)
    model = use_tiercache(tiny_llama())
    k = torch.randn(1, 2, 12, 16, generator=gen)
    v = torch.randn(1, 2, 12, 16, generator=gen)
    q = torch.randn(1, 4, 12, 16, generator=gen)
    with tiered(model, tmp_path) as kv:
        out = attend_after(TieredCache(kv, model), model, q, k, v, 0, scaling=0.5)
    want = causal_reference(q[0] * (0.5 * 4.0), k[0], v[0], 0)
    assert torch.allclose(out[0].transpose(0, 1).double(), want, rtol=1e-5, atol=1e-5)


# -- exact-id scenarios: prefix reuse --------------------------------------------------------
def test_second_prompt_reuses_the_stored_whole_blocks_of_its_shared_prefix(tmp_path):
    model = tiny_llama(seed=7)
    gen = torch.Generator().manual_seed(8)
    first = torch.randint(1, VOCAB, (1, 42), generator=gen)
    second = torch.cat([first[:, :35], torch.randint(1, VOCAB, (1, 9), generator=gen)], dim=1)
    want_tokens, want_logits = reference(model, second)
    with tiered(model, tmp_path) as kv:
        cache = TieredCache(kv, model, prompt=first)
        assert cache.cached_tokens == 0
        generate(model, first, cache)
        cache.free()
        assert match_prefix(kv, model, second) == 32  # 35 shared tokens: 4 whole blocks of 8
        tokens, logits = generate_reusing(model, kv, second, cached=32)
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() < 1e-5


def test_a_fully_stored_prompt_still_leaves_one_token_to_compute(tmp_path):
    model = tiny_llama(seed=10)
    ids = torch.randint(1, VOCAB, (1, 32), generator=torch.Generator().manual_seed(11))
    want_tokens, _ = reference(model, ids)
    with tiered(model, tmp_path) as kv:
        store(model, kv, ids)
        tokens, _ = generate_reusing(model, kv, ids, cached=24)  # 32 stored; the 32nd token's logits are needed
    assert torch.equal(tokens, want_tokens)


def test_batch_rows_start_from_the_prefix_every_row_has_stored(tmp_path):
    model = use_tiercache(tiny_llama(seed=12))
    gen = torch.Generator().manual_seed(13)
    base = torch.randint(1, VOCAB, (1, 40), generator=gen)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        store(model, kv, base, new=2)
        rows = torch.cat([base[:, :30], base[:, :30]], dim=0)
        rows[1, 20:] = torch.randint(1, VOCAB, (10,), generator=gen)  # row 1 shares 20 tokens: 2 blocks
        want_tokens, _ = reference(model, rows)
        tokens, _ = generate_reusing(model, kv, rows, cached=16)
    assert torch.equal(tokens, want_tokens)


def test_a_chat_turn_reuses_the_generated_tokens_of_the_turn_before(tmp_path):
    model = use_tiercache(tiny_llama(seed=23))
    gen = torch.Generator().manual_seed(24)
    turn1 = torch.randint(1, VOCAB, (1, 21), generator=gen)
    with tiered(model, tmp_path, hbm=6, dram=6) as kv:
        tokens = store(model, kv, turn1, new=20)  # 21 + 19 tokens of KV: 5 whole blocks
        turn2 = torch.cat([tokens, torch.randint(1, VOCAB, (1, 6), generator=gen)], dim=1)
        assert match_prefix(kv, model, turn2) == 40  # the blocks of generated tokens have content keys
        want_tokens, want_logits = reference(model, turn2)
        got_tokens, got_logits = generate_reusing(model, kv, turn2, cached=40)
    assert torch.equal(got_tokens, want_tokens)
    assert (got_logits - want_logits).abs().max().item() < 1e-5


def test_ids_other_than_the_prompt_are_refused_before_anything_is_stored(tmp_path):
    model = use_tiercache(tiny_llama(seed=25))
    gen = torch.Generator().manual_seed(26)
    prompt = torch.randint(1, VOCAB, (1, 30), generator=gen)
    other = prompt.clone()
    other[0, 5] = (other[0, 5] % (VOCAB - 1)) + 1
    with tiered(model, tmp_path) as kv:
        with pytest.raises(UserError, match="differ from the ids"):
            generate(model, other, TieredCache(kv, model, prompt=prompt))
        assert match_prefix(kv, model, other) == 0 and match_prefix(kv, model, prompt) == 0


# -- sparse decode ----------------------------------------------------------------------------
def test_sparse_decode_with_every_block_in_budget_equals_exact(tmp_path):
    model = use_tiercache(tiny_llama(seed=14))
    ids = torch.randint(1, VOCAB, (1, 50), generator=torch.Generator().manual_seed(15))
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        exact, _ = generate(model, ids, TieredCache(kv, model))
    with tiered(model, tmp_path / "b", hbm=8, dram=8) as kv:
        sparse, _ = generate(model, ids, TieredCache(kv, model, AttentionMode.SPARSE, budget=1.0))
    assert torch.equal(sparse, exact)


def test_sparse_decode_reads_only_its_budget(tmp_path):
    model = use_tiercache(tiny_llama(seed=16))
    ids = torch.randint(1, VOCAB, (1, 64), generator=torch.Generator().manual_seed(17))
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        cache = TieredCache(kv, model, AttentionMode.SPARSE, budget=3)
        generate(model, ids, cache, new=6)
        decode = [r for r in cache.sequences[0].reports if r.mode is AttentionMode.SPARSE]
    assert decode and all(r.selected == 3 for r in decode)


# -- fault injection --------------------------------------------------------------------------
def test_a_corrupt_nvme_chunk_raises_instead_of_attending_over_the_rest(tmp_path):
    model = use_tiercache(tiny_llama(seed=18))
    ids = torch.randint(1, VOCAB, (1, 60), generator=torch.Generator().manual_seed(19))
    with tiered(model, tmp_path, hbm=2, dram=2) as kv:
        cache = TieredCache(kv, model)
        model(ids, cache=cache)
        chunks = sorted(p for p in (tmp_path / "nvme").rglob("*") if p.is_file() and p.stat().st_size > 1000)
        assert chunks, "no NVMe chunk was written"
        for path in chunks:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        with pytest.raises(RuntimeError):
            model(ids[:, -1:] * 0 + 1, cache=cache)


# -- limits, each named -----------------------------------------------------------------------
def test_a_model_not_switched_to_tiercache_is_refused(tmp_path):
    model = tiny_llama()
    with tiered(model, tmp_path) as kv, pytest.raises(UserError, match="use_tiercache"):
        TieredCache(kv, model)


def test_switching_attention_away_after_the_cache_is_made_raises_at_the_next_pass(tmp_path):
    model = use_tiercache(tiny_llama())
    ids = torch.randint(1, VOCAB, (1, 20), generator=torch.Generator().manual_seed(20))
    with tiered(model, tmp_path) as kv:
        cache = TieredCache(kv, model)
        model.set_attn_implementation("sdpa")
        model(ids, cache=cache)  # a first pass over an empty cache is plain causal attention
        with pytest.raises(UserError, match="left new KV unread"):
            model(ids[:, :1], cache=cache)


def test_tiercache_attention_without_a_tiered_cache_is_refused():
    model = use_tiercache(tiny_llama())
    with pytest.raises(UserError, match="needs a TieredCache"):
        model(torch.ones(1, 4, dtype=torch.long), use_cache=False)


def padded_batch(gen, lengths, width):
    """Left-padded rows of random ids (pad id 0) and their attention mask."""
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask


def test_a_left_padded_batch_matches_dynamic_cache_and_each_row_alone(tmp_path):
    model = use_tiercache(tiny_llama(seed=29))
    model.generation_config.eos_token_id = None  # every row generates all 10 tokens
    ids, mask = padded_batch(torch.Generator().manual_seed(30), [33, 21, 8], 33)
    model.set_attn_implementation("sdpa")
    want = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    alone = [model.generate(ids[r : r + 1, mask[r].bool()], max_new_tokens=10, do_sample=False, pad_token_id=0)[0, -10:]
             for r in range(3)]
    use_tiercache(model)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv:
        cache = TieredCache(kv, model, prompt=ids, attention_mask=mask)
        got = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert [seq.length(0) for seq in cache.sequences] == [33 + 9, 21 + 9, 8 + 9]  # padding is not stored
        cache.free()
        assert match_prefix(kv, model, ids[1, mask[1].bool()]) == 16  # the row's own tokens, keyed without padding
    assert torch.equal(got, want)
    for row in range(3):
        assert torch.equal(got[row, -10:], alone[row])


def test_padding_after_a_token_is_refused(tmp_path):
    model = use_tiercache(tiny_llama())
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(21))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding
    with tiered(model, tmp_path) as kv, pytest.raises(UserError, match="only left padding"):
        model(ids, attention_mask=mask, cache=TieredCache(kv, model))
    mask[1, 9:] = 1
    mask[0, 4] = 0  # a hole
    with tiered(model, tmp_path / "b") as kv, pytest.raises(UserError, match="only left padding"):
        model(ids, attention_mask=mask, cache=TieredCache(kv, model))


def test_a_custom_mask_is_refused(tmp_path):
    model = use_tiercache(tiny_llama())
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(31))
    custom = torch.ones(1, 1, 6, 6, dtype=torch.bool)  # bidirectional: not causal
    with tiered(model, tmp_path) as kv, pytest.raises(UserError, match="not causal"):
        model(ids, attention_mask=custom, cache=TieredCache(kv, model))


@pytest.mark.parametrize("options, message", [
    ({"mode": AttentionMode.SPARSE}, "budget"),
    ({"budget": 2}, "budget"),
    ({"mode": "sparse", "budget": 2}, "AttentionMode"),
    ({"prompt": torch.ones(1, 2, 3, dtype=torch.long)}, "prompt"),
])
def test_bad_options_are_named(tmp_path, options, message):
    model = use_tiercache(tiny_llama())
    with tiered(model, tmp_path) as kv, pytest.raises(UserError, match=message):
        TieredCache(kv, model, **options)


def test_a_layout_that_does_not_match_the_model_is_refused(tmp_path):
    model = use_tiercache(tiny_llama())
    other = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4)
    tiers = [TierConfig("hbm", 8)]
    with TieredKVCache(kv_layout(other, torch.float32, BLOCK), tiers, device="cpu") as kv:
        with pytest.raises(UserError, match="kv_heads=4"):
            TieredCache(kv, model)


def test_kv_layout_reads_the_config():
    layout = kv_layout(tiny_llama().config, torch.bfloat16, 16)
    assert (layout.layers, layout.kv_heads, layout.head_dim, layout.dtype, layout.block_tokens) == (2, 2, 16, "bfloat16", 16)
    assert layout.per_layer
    with pytest.raises(UserError, match="kv_layout"):
        kv_layout(object(), torch.float32)
    with pytest.raises(UserError, match="kv_layout"):
        kv_layout(tiny_llama().config, torch.int32)
    assert np.isfinite(layout.bytes_per_token)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "sliced"])
@pytest.mark.parametrize("seed", range(3))
def test_both_causal_paths_match_a_float64_reference(monkeypatch, fused, seed):
    """``causal_partial`` over fresh random inputs: the fused CPU flash path and the sliced
    path (padding, other devices, overflow) against float64 causal attention."""
    from tiercache.integrations import causal

    if not fused:
        monkeypatch.setattr(causal, "_fused_causal", lambda *args: None)
    gen = torch.Generator().manual_seed(seed)
    kv_heads, group, tokens, dim = 1 + seed, 3 - seed, 5 + 40 * seed, 8 * (1 + seed)
    q = torch.randn(kv_heads * group, tokens, dim, generator=gen) * 4
    k = torch.randn(kv_heads, tokens, dim, generator=gen) * 4
    v = torch.randn(kv_heads, tokens, dim, generator=gen)
    part = causal.causal_partial(q, k, v, torch.float32)
    got = part.out.reshape(kv_heads * group, tokens, dim).double()
    assert torch.allclose(got, causal_reference(q, k, v, 0), rtol=1e-5, atol=1e-5)
    scores = (q.double() @ k.double().repeat_interleave(group, 0).transpose(1, 2)) / math.sqrt(dim)
    lse = torch.logsumexp(scores.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), -math.inf), -1)
    assert torch.allclose(part.lse.reshape(kv_heads * group, tokens).double(), lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("score", [1e1, 1e3, 1e5, 1e7])
def test_keys_tied_across_the_held_and_the_new_part_keep_their_count(score):
    """Held keys (value 0) and new keys (value 1) all score ``score``: query ``i`` sees 16
    held and ``i + 1`` new keys, so its output is ``(i + 1) / (17 + i)`` whatever the score
    (a merged log-sum-exp alone would round the counts away next to a large peak)."""
    from tiercache.attention import merge, partial_attention
    from tiercache.integrations.causal import causal_partial

    tokens, held, dim = 16, 16, 2
    side = math.sqrt(score * math.sqrt(dim))
    key = torch.tensor([side, 0.0])
    q = key.expand(1, tokens, dim).clone()
    new = causal_partial(q, key.expand(1, tokens, dim).clone(), torch.tensor([0.0, 1.0]).expand(1, tokens, dim).clone(),
                         torch.float32)
    old = partial_attention(q.reshape(1, tokens, dim), key.expand(1, held, dim).clone(), torch.zeros(1, held, dim))
    got = merge(old, new).out[0, :, 1]
    exact = torch.tensor([(i + 1) / (held + i + 1) for i in range(tokens)])
    assert (got - exact).abs().max().item() < 1e-5
