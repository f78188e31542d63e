"""Beam search and several sequences per prompt through a ``TieredCache`` (rows forked with
``Sequence.fork``).

Tiered-vs-dense equivalence: beam search (``num_beams``, with ``num_return_sequences``) and seeded
sampling of several sequences per prompt give the same tokens as transformers' ``DynamicCache``,
on a cache that opens its rows at the first pass and on one made with ``prompt=`` whose held rows
are repeated by forks, while the KV spills to NVMe. Exact ids: every row is released at ``free``
(no hold left behind by the forks of the reorders), and a first pass that fails having stored
nothing undoes the repeated rows. Bad input: a row order out of range, a reorder during a pass,
one layer's reorder.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers cache needs the hf extra (pip install -e '.[hf]')")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiercache import TieredKVCache  # noqa: E402
from tiercache.config import TierConfig  # noqa: E402
from tiercache.errors import UserError  # noqa: E402
from tiercache.integrations.transformers import TieredCache, kv_layout, use_tiercache  # noqa: E402

BEAMS = {"num_beams": 3, "do_sample": False, "num_return_sequences": 2}
SAMPLES = {"do_sample": True, "num_return_sequences": 3}


def _model(seed: int = 7) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def _tiered(model, tmp_path) -> TieredKVCache:
    tiers = [TierConfig("hbm", 3), TierConfig("dram", 3), TierConfig("nvme", 400)]
    return TieredKVCache(kv_layout(model.config, torch.float32, 4), tiers, path=tmp_path / "nvme", device="cpu")


def _generate(model, ids, cache=None, seed: int = 5, **options) -> torch.Tensor:
    torch.manual_seed(seed)
    extra = {} if cache is None else {"cache": cache}
    return model.generate(ids, max_new_tokens=8, min_new_tokens=8, pad_token_id=0, **extra, **options)


@pytest.mark.parametrize("options", [BEAMS, SAMPLES], ids=["beams", "samples"])
@pytest.mark.parametrize("with_prompt", [False, True], ids=["rows-at-first-pass", "prompt="])
def test_several_sequences_per_prompt_match_a_dynamic_cache(tmp_path, options, with_prompt):
    model = _model()
    ids = torch.randint(1, 128, (2, 23), generator=torch.Generator().manual_seed(1))
    want = _generate(model, ids, **options)
    use_tiercache(model)
    with _tiered(model, tmp_path) as kv:
        if with_prompt:  # store the prompts' blocks first, so the held rows start from them
            TieredCache(kv, model, prompt=ids).free()
            _generate(model, ids, TieredCache(kv, model), num_beams=1, do_sample=False)
        cache = TieredCache(kv, model, prompt=ids) if with_prompt else TieredCache(kv, model)
        assert cache.cached_tokens == (20 if with_prompt else 0)
        got = _generate(model, ids, cache, **options)
        assert torch.equal(got, want)
        assert len(cache.sequences) == 2 * max(options.get("num_beams", 1), options["num_return_sequences"])
        cache.free()
        assert not kv.manager.held
        kv.check_invariants()


def test_a_first_pass_that_fails_undoes_the_repeated_rows(tmp_path):
    model = _model()
    ids = torch.randint(1, 128, (1, 13), generator=torch.Generator().manual_seed(2))
    want = _generate(model, ids, do_sample=False)
    use_tiercache(model)
    with _tiered(model, tmp_path) as kv:
        _generate(model, ids, TieredCache(kv, model), do_sample=False)
        cache = TieredCache(kv, model, prompt=ids)
        held = dict(kv.manager.held)

        def fail(*args, **kwargs):
            raise RuntimeError("a processor failed")

        layer = model.model.layers[0].self_attn.q_proj
        handle = layer.register_forward_pre_hook(fail)
        try:
            with pytest.raises(RuntimeError, match="a processor failed"):
                _generate(model, ids, cache, **SAMPLES)
        finally:
            handle.remove()
        assert len(cache.sequences) == 3  # repeated at the first pass, which failed before storing
        got = _generate(model, ids, cache, do_sample=False)  # the next pass undoes them first
        assert len(cache.sequences) == 1 and torch.equal(got, want)
        cache.free()
        assert dict(kv.manager.held) == {} and held


def test_bad_reorders_are_refused_and_change_nothing(tmp_path):
    model = use_tiercache(_model())
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with _tiered(model, tmp_path) as kv:
        cache = TieredCache(kv, model)
        with torch.no_grad():
            model(ids, cache=cache)
        rows = list(cache.sequences)
        for order in ([0, 2], [], [-1, 0]):
            with pytest.raises(UserError, match="row order"):
                cache.reorder_cache(torch.tensor(order, dtype=torch.long))
        with pytest.raises(UserError, match="every layer at once"):
            cache.layers[0].reorder_cache(torch.tensor([1, 0]))
        cache._open_pass = [9, 9]
        with pytest.raises(UserError, match="between passes only"):
            cache.reorder_cache(torch.tensor([1, 1]))
        cache._open_pass = None
        assert cache.sequences == rows
        cache.reorder_cache(torch.tensor([1, 1, 0]))
        assert cache.sequences[0] is rows[1] and cache.sequences[2] is rows[0] and cache.sequences[1].length(1) == 9
        cache.free()
        assert not kv.manager.held


def test_continuing_after_a_beam_search_says_how(tmp_path):
    """Probe R8: the rows are the last beams, not the returned sequences; the refusal said to
    continue from the ids generate returned, which is what failed."""
    model = use_tiercache(_model())
    ids = torch.randint(1, 128, (1, 13), generator=torch.Generator().manual_seed(4))
    with _tiered(model, tmp_path) as kv:
        cache = TieredCache(kv, model)
        out = _generate(model, ids, cache, **BEAMS)
        with pytest.raises(UserError, match=r"last beams of a beam search.*prompt=ids"):
            _generate(model, out, cache, do_sample=False)
        cache.free()
        again = TieredCache(kv, model, prompt=out[:1])
        assert again.cached_tokens >= 16  # the returned sequence's blocks are stored
        _generate(model, out[:1], again, do_sample=False)
        again.free()
        assert not kv.manager.held
