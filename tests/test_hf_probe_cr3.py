"""The drop-in ``transformers`` cache against probe CR3's findings: every row of a ``prompt=``
batch starts from the same reused prefix even when one row's lookup comes up short (a block
evicted in between, a corrupt chunk); a sliding window that a later layer outgrows is refused
before any layer stores; ``crop``, ``reorder_cache`` and ``copy.deepcopy`` run after a pass
that failed having stored nothing; ``generate(use_cache=False)`` is refused before any pass.
Each test failed before its fix. Tiny random-weight models built from configs, on the CPU.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="the transformers cache needs the hf extra")

from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from test_hf_cache import BLOCK, VOCAB, generate, reference, tiny_llama  # noqa: E402
from test_hf_cache_probe import ids_of  # noqa: E402

from tiercache import TieredKVCache  # noqa: E402
from tiercache.config import TierConfig  # noqa: E402
from tiercache.errors import UserError  # noqa: E402
from tiercache.integrations.transformers import TieredCache, kv_layout, match_prefix, use_tiercache  # noqa: E402


def store_of(model, path, hbm: int, dram: int, nvme: int) -> TieredKVCache:
    tiers = [TierConfig("hbm", hbm), TierConfig("dram", dram), TierConfig("nvme", nvme)]
    return TieredKVCache(kv_layout(model.config, torch.float32, BLOCK), tiers, path=path, device="cpu")


def stored(model, kv, *prompts) -> None:
    """Runs each prompt through a cache made with it, then frees it (its blocks stay stored)."""
    for ids in prompts:
        cache = TieredCache(kv, model, prompt=ids)
        with torch.no_grad():
            model(ids, cache=cache)
        cache.free()


def lengths(cache) -> list[list[int]]:
    """Tokens of KV per row, per layer."""
    return [[seq.length(layer) for layer in range(cache.kv.layout.layers)] for seq in cache.sequences]


# -- finding 1: rows of a prompt= batch out of step ----------------------------------------------
@pytest.mark.parametrize("short_row", [0, 1])
def test_a_batch_row_that_lost_its_prefix_in_between_keeps_every_row_in_step(tmp_path, short_row):
    """Another request on the same store evicts one row's prefix between the batch's lookup
    (both rows: 40 tokens) and that row's sequence: every row starts from 0 (row 1 attended
    over its 40 reused tokens twice: other tokens, no error; or a misleading refusal)."""
    model = tiny_llama(seed=7)
    prompts = [ids_of(41, 70), ids_of(41, 71)]
    batch = torch.cat(prompts)
    want, _ = reference(model, batch, new=6)
    use_tiercache(model)
    with store_of(model, tmp_path / "nvme", hbm=2, dram=2, nvme=40) as kv:
        stored(model, kv, *prompts)
        assert [match_prefix(kv, model, ids) for ids in prompts] == [40, 40]
        real, calls, found = kv.sequence, [], []

        def another_request_first(*args, **kwargs):
            if len(calls) == short_row:  # what a second thread's request does between the two lock holds
                other = real()
                for _ in range(17 * BLOCK):
                    for layer in range(2):
                        other.append(layer, torch.randn(2, 1, 16), torch.randn(2, 1, 16))
                other.free()
                found.extend(match_prefix(kv, model, ids) for ids in prompts)
            calls.append(1)
            return real(*args, **kwargs)

        kv.sequence = another_request_first
        cache = TieredCache(kv, model, prompt=batch)
        kv.sequence = real
        assert found[short_row] == 0 and found[1 - short_row] == 40  # the rows' lookups now disagree
        assert [seq.cached_tokens for seq in cache.sequences] == [0, 0]
        assert cache.cached_tokens == 0 and cache.get_seq_length() == 0
        got, _ = generate(model, batch, cache, new=6)
        assert lengths(cache) == [[46, 46], [46, 46]]
        cache.free()
        assert not kv.manager.held
    assert torch.equal(got, want)


def test_a_corrupt_chunk_of_one_rows_prefix_keeps_every_row_in_step(tmp_path):
    """A reopened store where one NVMe chunk of row 0's prefix is corrupt: the lookup finds 40
    tokens for both rows, row 0's sequence finds the chunk corrupt and starts from 0, so row 1
    is cut back to 0 too (it kept 40 and attended over them twice: other tokens, no error)."""
    model = tiny_llama(seed=7)
    prompts = [ids_of(41, 70), ids_of(41, 71)]
    batch = torch.cat(prompts)
    want, _ = reference(model, batch, new=6)
    use_tiercache(model)
    path = tmp_path / "nvme"

    def chunks():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.stat().st_size > 1000)

    victim = None
    for ids in prompts:  # each prompt stored by its own run of a persisted store
        kv = store_of(model, path, hbm=2, dram=2, nvme=40)
        stored(model, kv, ids)
        kv.close(persist=True)
        victim = victim or chunks()[0]  # a chunk of row 0's prefix
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with store_of(model, path, hbm=2, dram=2, nvme=40) as kv:
        assert [match_prefix(kv, model, ids) for ids in prompts] == [40, 40]  # it reads no chunk
        cache = TieredCache(kv, model, prompt=batch)
        assert [seq.cached_tokens for seq in cache.sequences] == [0, 0]
        got, _ = generate(model, batch, cache, new=6)
        assert lengths(cache) == [[46, 46], [46, 46]]
        cache.free()
    assert torch.equal(got, want)


# -- finding 2: a sliding window outgrown at a layer after the first ----------------------------
def hybrid_qwen2(seed: int) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 whose layer 0 is full attention and layer 1 a 16-token sliding window."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         use_sliding_window=True, sliding_window=16, max_window_layers=1, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).eval()
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    return model


def test_a_window_outgrown_at_a_later_layer_is_refused_before_any_layer_stores(tmp_path):
    model = hybrid_qwen2(seed=72)
    ids = ids_of(10, 73)
    want, _ = reference(model, ids, new=6)
    use_tiercache(model)
    with store_of(model, tmp_path / "nvme", hbm=8, dram=8, nvme=64) as kv:
        cache = TieredCache(kv, model)
        generate(model, ids, cache, new=7)  # 16 positions fed: the window's length
        step = torch.tensor([[5]])
        with torch.no_grad(), pytest.raises(UserError, match=r"sliding_window=16 .* \(17 positions\)"):
            model(step, cache=cache, position_ids=torch.tensor([[16]]))
        assert lengths(cache) == [[16, 16]]  # was [[17, 16]]: layer 0 had stored the step
        cache.crop(-8)  # was refused: the cache could only be freed
        got, _ = generate(model, ids, cache, new=6)  # 15 positions: inside the window
        assert lengths(cache) == [[15, 15]]
    assert torch.equal(got, want)


def test_a_generate_that_would_outgrow_a_window_is_refused_before_it_runs(tmp_path):
    """Probe finding: a generate whose ``prompt + max_new_tokens`` outgrew a window ran until
    the pass that outgrew it, then was refused, losing every token it had computed."""
    model = hybrid_qwen2(seed=72)
    ids = ids_of(10, 73)
    want, _ = reference(model, ids, new=7)
    use_tiercache(model)
    with store_of(model, tmp_path / "nvme", hbm=8, dram=8, nvme=64) as kv:
        cache = TieredCache(kv, model)
        for asked in (dict(max_new_tokens=8), dict(max_length=18), dict(generation_config=GenerationConfig(
                max_new_tokens=12, do_sample=False)), {}, dict(generation_config=GenerationConfig(do_sample=False)),
                dict(inputs_embeds=model.get_input_embeddings()(ids).detach(), max_length=18)):
            # review R33: no length anywhere (generate's default of 20 new tokens) ran 7 passes first
            with pytest.raises(UserError, match=r"sliding_window=16 .*nothing was run.* at most 7 new tokens"):
                model.generate(None if "inputs_embeds" in asked else ids, cache=cache, do_sample=False, pad_token_id=0,
                               **asked)
            assert lengths(cache) == [] and not kv.manager.held
        with pytest.raises(UserError, match=r"max_new_tokens=7 with prompt_lookup_num_tokens=3 would feed 18 positions"
                                            r".* at most 5 new tokens"):  # its last verification feeds 2 past the end
            model.generate(ids, cache=cache, do_sample=False, pad_token_id=0, max_new_tokens=7, prompt_lookup_num_tokens=3)
        with pytest.raises(UserError, match="max_length=30 would feed 29 positions.*no room for a new token"):
            model.generate(ids_of(17, 74), cache=cache, do_sample=False, pad_token_id=0, max_length=30)
        model.generation_config.max_new_tokens = 7  # a passed config's unset options come from the model's
        try:  # max_new_tokens=7 (the model's) takes precedence over the passed max_length=30: it fits
            got = model.generate(ids, generation_config=GenerationConfig(max_length=30, do_sample=False), cache=cache,
                                 pad_token_id=0)
        finally:
            model.generation_config.max_new_tokens = None
        assert got.shape[1] == 17 and lengths(cache) == [[16, 16]]
        cache.free()
        got, _ = generate(model, ids, cache, new=7)  # 16 positions: the window's length
        assert lengths(cache) == [[16, 16]]
    assert torch.equal(got, want)


def test_a_keyword_given_as_none_overrides_the_model_config_as_in_transformers(tmp_path):
    """Review R34: ``max_new_tokens=None`` sets None over the model's config in transformers
    (``GenerationConfig.update``); the check took the model's 50 and refused a generate
    whose ``max_length=17`` fits the 16-token window."""
    model = hybrid_qwen2(seed=72)
    ids = ids_of(10, 73)
    want, _ = reference(model, ids, new=7)
    use_tiercache(model)
    model.generation_config.max_new_tokens = 50
    with store_of(model, tmp_path / "nvme", hbm=8, dram=8, nvme=64) as kv:
        cache = TieredCache(kv, model)
        got = model.generate(ids, cache=cache, do_sample=False, pad_token_id=0, max_new_tokens=None, max_length=17)
        assert lengths(cache) == [[16, 16]]
        cache.free()
        with pytest.raises(UserError, match=r"max_new_tokens=50 would feed"):
            model.generate(ids, cache=cache, do_sample=False, pad_token_id=0, max_length=17)  # the model's 50 counts
    assert torch.equal(got, want)


def test_a_first_pass_longer_than_a_later_layers_window_stores_nothing(tmp_path):
    model = hybrid_qwen2(seed=74)
    ids = ids_of(20, 75)
    want, _ = reference(model, ids[:, :12], new=3)
    use_tiercache(model)
    with store_of(model, tmp_path / "nvme", hbm=8, dram=8, nvme=64) as kv:
        cache = TieredCache(kv, model)
        with torch.no_grad(), pytest.raises(UserError, match=r"sliding_window=16 .* \(20 positions\)"):
            model(ids, cache=cache)
        assert not kv.manager.held
        got, _ = generate(model, ids[:, :12], cache, new=3)  # was refused: "a pass failed after storing"
    assert torch.equal(got, want)


# -- finding 3: row operations after a failed pass that stored nothing ----------------------------
@pytest.mark.filterwarnings("ignore::tiercache.live.lifecycle.PersistWarning")  # a tiny NVMe tier: close keeps what fits, says so
def test_crop_reorder_and_copy_run_after_a_pass_that_failed_storing_nothing(tmp_path):
    """The tiers fill up at a decode step (nothing stored); crop gives room back (it was refused
    as 'between passes only', and the next pass failed for room the same way: free() only)."""
    model = tiny_llama(seed=76)
    ids = ids_of(31, 77, batch=2)
    want, _ = reference(model, ids, new=4)
    use_tiercache(model)
    with store_of(model, tmp_path / "nvme", hbm=1, dram=1, nvme=14) as kv:
        cache = TieredCache(kv, model)
        with pytest.raises(UserError, match="do not fit"):
            model.generate(ids, cache=cache, max_new_tokens=20, do_sample=False, pad_token_id=0)
        assert lengths(cache) == [[39, 39], [39, 39]]  # the failed step stored nothing
        rows = list(cache.sequences)
        cache.reorder_cache(torch.tensor([1, 0]))
        assert cache.sequences == rows[::-1]
        cache.reorder_cache(torch.tensor([1, 0]))
        twin = copy.deepcopy(cache)
        assert lengths(twin) == [[39, 39], [39, 39]]
        twin.free()
        cache.crop(-16)
        assert lengths(cache) == [[23, 23], [23, 23]]
        got, _ = generate(model, ids, cache, new=4)  # 34 positions: 16 blocks, what the tiers hold
    assert torch.equal(got, want)


def test_a_pass_that_stored_kv_still_keeps_row_operations_out(tmp_path):
    """A failed pass that stored KV (the layers out of step) is still refused, not settled."""
    model = use_tiercache(tiny_llama(seed=78))
    ids = ids_of(9, 79)
    with store_of(model, tmp_path / "nvme", hbm=8, dram=8, nvme=64) as kv:
        cache = TieredCache(kv, model)
        with torch.no_grad():
            model(ids, cache=cache)
        cache._open_pass, cache._pass_start = [9], 0  # as if a pass had stored its 9 tokens and raised
        with pytest.raises(UserError, match="rows are cropped between passes only"):
            cache.crop(-1)
        assert lengths(cache) == [[9, 9]] and cache._open_pass == [9]
        cache.free()


# -- finding 4: use_cache=False ------------------------------------------------------------------
@pytest.mark.parametrize("through_config", [False, True])
def test_use_cache_false_is_refused_before_any_pass(tmp_path, through_config):
    model = tiny_llama(seed=80)
    ids = ids_of(20, 81)
    want, _ = reference(model, ids, new=4)
    use_tiercache(model)
    with store_of(model, tmp_path / "nvme", hbm=8, dram=8, nvme=64) as kv:
        cache = TieredCache(kv, model)
        options = {"use_cache": False, "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
        given = {"generation_config": GenerationConfig(**options)} if through_config else options
        with pytest.raises(UserError, match=r"use_cache=False .*nothing was run and the cache is unchanged"):
            model.generate(ids, cache=cache, **given)
        assert cache.get_seq_length() == 0 and not kv.manager.held  # the prompt's KV was stored
        got, _ = generate(model, ids, cache, new=4)  # the retry was refused: 'must reach past the 20 positions'
    assert torch.equal(got, want)


def test_a_config_that_holds_its_windows_per_layer_leaves_the_check_to_each_layer():
    """A heterogeneous config (NeoMME) raises for its global ``sliding_window``: reading the
    windows up front must not refuse the model (each layer's attention checks its own)."""
    neomme = pytest.importorskip("transformers.models.neomme.configuration_neomme")
    from tiercache.integrations.inputs import sliding_windows

    config = neomme.NeoMMEConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=64, vocab_size=100)
    with pytest.raises(Exception, match="per-layer attribute"):
        config.sliding_window  # noqa: B018 - the access transformers refuses
    assert sliding_windows(config) == ()


def test_a_crop_into_a_rows_left_padding_says_the_padding_is_why(tmp_path):
    """Probe Q58 (minor): DynamicCache crops into a row's left padding; TieredCache cannot
    (the padding is not stored) and its refusal named only the row's token count."""
    model = use_tiercache(tiny_llama(seed=80))
    ids = ids_of(9, 81, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with store_of(model, tmp_path / "nvme", hbm=8, dram=8, nvme=64) as kv:
        cache = TieredCache(kv, model)
        with torch.no_grad():
            model(ids, attention_mask=mask, cache=cache)
        with pytest.raises(UserError, match="7 tokens to remove, but row 1 holds 4 after 5 positions of left "
                                            "padding, which crop cannot remove"):
            cache.crop(-7)
        assert lengths(cache) == [[9, 9], [4, 4]]
        cache.crop(-4)
        assert lengths(cache) == [[5, 5], [0, 0]]
