"""Probe Q31, finding 1 (the ``transformers`` drop-in cache): weights changed in place after
``use_tiercache`` (``load_state_dict``, a LoRA merge) were not fingerprinted again, so a new
``TieredCache(kv, model, prompt=...)`` reused the old weights' stored KV (56 cached tokens,
logits 0.66 off ``DynamicCache``'s) without an error. A cache now fingerprints the weights
anew when their stamp (identity, storage, version counter) changed since the stored
fingerprint was computed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers cache needs the hf extra (pip install -e '.[hf]')")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiercache import TieredKVCache  # noqa: E402
from tiercache.config import TierConfig  # noqa: E402
from tiercache.errors import UserError  # noqa: E402
from tiercache.integrations import checks  # noqa: E402
from tiercache.integrations.checks import FINGERPRINT  # noqa: E402
from tiercache.integrations.inputs import model_fingerprint  # noqa: E402
from tiercache.integrations.transformers import TieredCache, kv_layout, match_prefix, use_tiercache  # noqa: E402

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)


def _model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


def _kv(tmp_path, model) -> TieredKVCache:
    tiers = [TierConfig("hbm", 16), TierConfig("dram", 16), TierConfig("nvme", 64)]
    return TieredKVCache(kv_layout(model.config, torch.float32, 8), tiers, path=tmp_path / "nvme", device="cpu")


def _greedy(model, prompt, cache, new=6):
    with torch.no_grad():
        out = model.generate(prompt, cache=cache, max_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def test_weights_loaded_in_place_are_fingerprinted_anew_and_the_old_kv_is_not_reused(tmp_path):
    model, other = use_tiercache(_model(0)), _model(123)
    reference = _model(0)
    prompt = torch.randint(1, 128, (1, 64), generator=torch.Generator().manual_seed(4))
    with _kv(tmp_path, model) as kv:
        first = TieredCache(kv, model, prompt=prompt)
        _greedy(model, prompt, first, new=2)
        assert match_prefix(kv, model, prompt) == 64  # the prompt's blocks are stored
        model.load_state_dict(other.state_dict())  # in place: the same tensors, new values
        reference.load_state_dict(other.state_dict())
        assert match_prefix(kv, model, prompt) == 0  # the new weights' keys: nothing stored
        assert getattr(model, FINGERPRINT) == model_fingerprint(model)
        cache = TieredCache(kv, model, prompt=prompt)
        assert cache.cached_tokens == 0
        ids, logits = _greedy(model, prompt, cache)
        want_ids, want_logits = _greedy(reference, prompt, DynamicCache(config=reference.config))
        assert torch.equal(ids, want_ids)
        assert (logits - want_logits).abs().max() < 1e-4
        with pytest.raises(UserError, match="weights changed: tiercache found other weights since this cache was made"):
            with torch.no_grad():  # the cache made before the change refuses its next pass
                model(ids[:, -1:], cache=first)
        cache.free()
        first.free()


def test_a_change_that_keeps_the_values_keeps_the_fingerprint_and_the_reuse(tmp_path):
    model = use_tiercache(_model(0))
    prompt = torch.randint(1, 128, (1, 64), generator=torch.Generator().manual_seed(5))
    before = getattr(model, FINGERPRINT)
    with _kv(tmp_path, model) as kv:
        cache = TieredCache(kv, model, prompt=prompt)
        _greedy(model, prompt, cache, new=2)
        cache.free()
        with torch.no_grad():
            next(model.parameters()).mul_(1.0)  # the version counter moves, the values do not
        again = TieredCache(kv, model, prompt=prompt)
        assert getattr(model, FINGERPRINT) == before
        assert again.cached_tokens == 56  # whole blocks of 8, leaving the last token to compute
        again.free()


# ----------------------------------------------------------------------------- review R21


def test_a_cache_made_before_a_weight_change_refuses_its_next_pass_with_no_cache_made_between(tmp_path):
    """R21 finding 1: the old cache checked only the fingerprint stored on the model, which
    nothing had refreshed: it went on, storing the new weights' KV under the old weights' keys."""
    model, other = use_tiercache(_model(0)), _model(123)
    prompt = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(6))
    with _kv(tmp_path, model) as kv:
        cache = TieredCache(kv, model)
        ids, _ = _greedy(model, prompt, cache, new=2)
        with torch.no_grad():
            next(model.parameters()).add_(0.5)  # a LoRA merge, say
        with pytest.raises(UserError, match="weights changed"):
            with torch.no_grad():
                model(ids[:, -1:], cache=cache)
        model.load_state_dict(other.state_dict())
        with pytest.raises(UserError, match="weights changed"):
            _greedy(model, ids, cache, new=2)
        cache.free()


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
     "original_max_position_embeddings": 32}])
def test_rope_buffers_rewritten_as_a_sequence_grows_neither_refingerprint_nor_refuse(tmp_path, monkeypatch, rope):
    """R21 findings 2 and 3: dynamic and long RoPE rewrite the rotary ``inv_freq`` buffer (long
    RoPE in place at every pass): the next cache fingerprinted every weight again, and a live
    cache past the original length was refused as if the weights had changed."""
    torch.manual_seed(0)
    model = use_tiercache(LlamaForCausalLM(LlamaConfig(**(CONFIG | {"max_position_embeddings": 64,
                                                                     "rope_parameters": rope}))).eval())
    hashed = []
    real = checks.model_fingerprint
    monkeypatch.setattr(checks, "model_fingerprint", lambda m: (hashed.append(1), real(m))[1])
    prompt = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    with _kv(tmp_path, model) as kv:
        for _ in range(2):
            cache = TieredCache(kv, model, prompt=prompt)
            _greedy(model, prompt, cache, new=3)
            cache.free()
        first = TieredCache(kv, model)
        ids, _ = _greedy(model, prompt, first, new=50)  # past max_position_embeddings
        second = TieredCache(kv, model)
        with torch.no_grad():
            model(ids[:, -1:], cache=first)  # goes on
        assert hashed == []
        second.free()
        first.free()


# ----------------------------------------------------------------------------- review R22


def test_a_rewritten_rotary_buffer_of_a_static_rope_changes_the_keys(tmp_path):
    """R22 finding 1: the stamp left out the non-persistent ``inv_freq`` that the fingerprint
    hashes, so after a change of it a new cache reused 32 tokens of KV made with the old RoPE."""
    model = use_tiercache(_model(0))
    prompt = torch.randint(1, 128, (1, 33), generator=torch.Generator().manual_seed(7))
    with _kv(tmp_path, model) as kv:
        first = TieredCache(kv, model, prompt=prompt)
        ids, _ = _greedy(model, prompt, first, new=2)
        with torch.no_grad():
            model.model.rotary_emb.inv_freq.mul_(0.5)
        with pytest.raises(UserError, match="weights changed"):
            with torch.no_grad():
                model(ids[:, -1:], cache=first)
        first.free()
        again = TieredCache(kv, model, prompt=prompt)
        assert again.cached_tokens == 0
        again.free()


def test_a_model_built_under_inference_mode_can_be_readied(tmp_path):
    """R22 finding 3: an inference tensor keeps no version counter; reading it raised."""
    with torch.inference_mode():
        model = use_tiercache(_model(0))
        prompt = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(8))
        with _kv(tmp_path, model) as kv:
            cache = TieredCache(kv, model)
            ids = model.generate(prompt, cache=cache, max_new_tokens=2, do_sample=False)
            assert ids.shape == (1, 14)
            cache.free()
