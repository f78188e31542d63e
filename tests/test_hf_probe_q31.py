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
        with pytest.raises(UserError, match="found other weights since this cache was made"):
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
