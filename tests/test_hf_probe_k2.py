"""The drop-in ``transformers`` cache against probe K's findings on its hooks and inputs: a
decoder called with positional arguments is seen as the same call by keyword (custom positions,
a padded mask, embeddings), the weights fingerprint reads raw bytes (the same whatever torch's
thread count), ``match_prefix`` answers for one sequence only, and ``bench_hf_cache.py`` counts
the blocks a layer fills. Each test failed before its fix.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the transformers cache needs the hf extra")

from test_hf_cache import tiered, tiny_llama  # noqa: E402
from test_hf_cache_probe import ids_of  # noqa: E402

from tiercache.errors import UserError  # noqa: E402
from tiercache.integrations.inputs import model_fingerprint  # noqa: E402
from tiercache.integrations.transformers import TieredCache, match_prefix, use_tiercache  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# -- positional arguments of the decoder ---------------------------------------------------------
def test_a_positional_call_with_custom_positions_keeps_its_kv_private(tmp_path):
    model = use_tiercache(tiny_llama(seed=60))
    ids = ids_of(40, 61)
    positions = torch.arange(40).unsqueeze(0) * 5
    with tiered(model, tmp_path, hbm=8, dram=8) as kv, torch.no_grad():
        cache = TieredCache(kv, model)
        model.model(ids, None, positions, cache)  # LlamaModel.forward(input_ids, attention_mask, position_ids, cache)
        cache.free()
        assert TieredCache(kv, model, prompt=ids).cached_tokens == 0  # KV at positions 0, 5, 10... is not keyed
        assert match_prefix(kv, model, ids) == 0


def test_a_positional_left_padded_mask_is_read_as_the_keyword_one(tmp_path):
    model = use_tiercache(tiny_llama(seed=62))
    ids = ids_of(20, 63, batch=2)
    ids[1, :5] = 0
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0
    with tiered(model, tmp_path, hbm=8, dram=8) as kv, torch.no_grad():
        by_keyword = TieredCache(kv, model)
        want = model.model(input_ids=ids, attention_mask=mask, cache=by_keyword).last_hidden_state
        by_position = TieredCache(kv, model)
        got = model.model(ids, mask, None, by_position).last_hidden_state
        assert [seq.length(0) for seq in by_position.sequences] == [20, 15]  # the padding is not stored
        assert torch.equal(got[0], want[0]) and torch.equal(got[1, 5:], want[1, 5:])


def test_positional_embeddings_are_seen_and_make_the_kv_private(tmp_path):
    model = use_tiercache(tiny_llama(seed=64))
    ids = ids_of(24, 65)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv, torch.no_grad():
        cache = TieredCache(kv, model)
        model.model(None, None, None, cache, model.model.embed_tokens(ids))  # (..., cache, inputs_embeds)
        assert cache.seq_length(0) == 24
        cache.free()
        assert match_prefix(kv, model, ids) == 0  # computed from embeddings: no content keys


# -- the weights fingerprint -------------------------------------------------------------------------
def test_the_fingerprint_is_the_same_whatever_torchs_thread_count():
    torch.manual_seed(66)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    threads = torch.get_num_threads()
    try:
        prints = set()
        for count in (1, 2, 4, 7):
            torch.set_num_threads(count)
            prints.add(model_fingerprint(model))
    finally:
        torch.set_num_threads(threads)
    assert len(prints) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_fingerprint_is_the_same_on_the_cpu_and_on_cuda():
    model = tiny_llama(seed=68)
    on_cpu = model_fingerprint(model)
    assert model_fingerprint(model.to("cuda")) == on_cpu


def test_a_weight_without_readable_values_is_refused_naming_it():
    with torch.device("meta"):
        model = tiny_llama(seed=69)
    with pytest.raises(UserError, match="model.embed_tokens.weight"):
        model_fingerprint(model)


# -- match_prefix answers for one sequence -------------------------------------------------------------
def test_match_prefix_refuses_a_batch_instead_of_joining_its_rows(tmp_path):
    model = use_tiercache(tiny_llama(seed=70))
    stored, other = ids_of(40, 71), ids_of(40, 72)
    with tiered(model, tmp_path, hbm=8, dram=8) as kv, torch.no_grad():
        cache = TieredCache(kv, model, prompt=stored)
        model(stored, cache=cache)
        cache.free()
        assert match_prefix(kv, model, stored) == match_prefix(kv, model, stored[0]) == 40
        assert match_prefix(kv, model, stored[0].tolist()) == 40
        assert match_prefix(kv, model, other) == 0
        with pytest.raises(UserError, match="2 rows; .*once per row"):
            match_prefix(kv, model, torch.cat([stored, other]))
        with pytest.raises(UserError, match="match_prefix: tokens rows differ in length; call match_prefix once"):
            match_prefix(kv, model, [[1, 2, 3], [4, 5]])
        assert TieredCache(kv, model, prompt=torch.cat([stored, other])).cached_tokens == 0


# -- bench_hf_cache.py's header -------------------------------------------------------------------------
def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"probe_k2_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_hf_cache_counts_the_blocks_a_layer_fills(tmp_path, capsys):
    bench = load_script("bench_hf_cache")
    out = tmp_path / "bench.json"
    argv = ["--context", "60", "--new", "4", "--block-tokens", "16", "--rounds", "1", "--layers", "1",
            "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--device", "cpu", "--out", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["blocks_per_layer"] == 4  # 64 tokens: exactly 4 blocks of 16
    assert "HBM holds 2 of 4 whole blocks per layer" in capsys.readouterr().out
    assert [bench.blocks_per_layer(n, 16) for n in (1, 16, 17, 64, 65)] == [1, 1, 2, 4, 5]
