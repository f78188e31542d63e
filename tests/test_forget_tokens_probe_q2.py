"""``Sequence.forget_tokens`` (probe Q2): once a sequence's KV depends on more than its ids (an
image, embeddings), no later block gets a content key, whatever ids ``add_tokens`` tells after
(they would name positions whose KV is the image's: a prompt without the image matched it); a
numpy integer is an integer; ``private=False`` only takes back ids told ahead of their KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiercache import TieredKVCache
from tiercache.config import KVLayout, TierConfig
from tiercache.errors import UserError

LAYOUT = KVLayout(1, 1, 4, "float32", 4)
PROMPT = list(range(1, 17))  # 4 blocks; positions 6..9 stand for an image


def _cache(tmp_path) -> TieredKVCache:
    tiers = [TierConfig("hbm", 4), TierConfig("dram", 4), TierConfig("nvme", 50)]
    return TieredKVCache(LAYOUT, tiers, path=tmp_path / "nvme", device="cpu")


def _kv(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, t, 4, generator=g), torch.randn(1, t, 4, generator=g)


def test_ids_told_after_a_forget_key_no_block_past_it(tmp_path):
    with _cache(tmp_path) as cache:
        seq = cache.sequence(tokens=PROMPT[:6])
        seq.append(0, *_kv(4, 0))
        seq.forget_tokens(6)  # the image starts at 6
        seq.add_tokens(PROMPT[10:16])  # the text after the image
        seq.append(0, *_kv(12, 1))  # image KV (6..9), then the text's (10..15)
        assert seq.blocks() == 4
        seq.free()
        without_image = PROMPT[:6] + PROMPT[10:16] + [0]
        assert cache.match_prefix(without_image) == 4  # the first block only: it ends before the image
        assert cache.match_prefix(PROMPT + [0]) == 4


def test_a_fork_keeps_its_sources_forgotten_ids_private(tmp_path):
    with _cache(tmp_path) as cache:
        seq = cache.sequence(tokens=PROMPT[:6])
        seq.append(0, *_kv(4, 2))
        seq.forget_tokens(np.int64(6))  # a numpy integer is an integer
        twin = seq.fork()
        twin.add_tokens(PROMPT[6:16])
        twin.append(0, *_kv(12, 3))
        twin.free()
        seq.free()
        assert cache.match_prefix(PROMPT + [0]) == 4


def test_ids_taken_back_with_private_false_can_be_told_again(tmp_path):
    with _cache(tmp_path) as cache:
        seq = cache.sequence(tokens=PROMPT[:4])
        seq.append(0, *_kv(4, 4))
        seq.add_tokens([99, 98, 97, 96])  # told ahead of its KV, then taken back (a failed pass)
        seq.forget_tokens(4, private=False)
        seq.add_tokens(PROMPT[4:16])
        seq.append(0, *_kv(12, 5))
        seq.free()
        assert cache.match_prefix(PROMPT + [0]) == 16


@pytest.mark.parametrize("keep", [3, 4.0, True, "6", None])
def test_a_bad_keep_is_refused_naming_it(tmp_path, keep):
    with _cache(tmp_path) as cache:
        seq = cache.sequence(tokens=PROMPT)
        seq.append(0, *_kv(4, 6))
        with pytest.raises(UserError, match=r"keep must be an integer >= 4 \(tokens of KV held\), got"):
            seq.forget_tokens(keep)
        assert len(seq.token_ids) == 16
        seq.free()


def test_a_refused_embeddings_pass_leaves_the_prompts_prefix_reusable(tmp_path):
    """Probe R7: the cache takes back a row's ids before an embeddings pass; when the pass is
    refused before it stores anything, the ids come back and the prompt's blocks get content
    keys as before (a permanent forget made every later block private)."""
    transformers = pytest.importorskip("transformers")
    from tiercache.integrations.transformers import TieredCache, kv_layout, use_tiercache

    torch.manual_seed(7)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      attn_implementation="sdpa")
    model = use_tiercache(transformers.LlamaForCausalLM(config).eval())
    prompt = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    tiers = [TierConfig("hbm", 3), TierConfig("dram", 3), TierConfig("nvme", 200)]
    with TieredKVCache(kv_layout(model.config, torch.float32, 4), tiers, path=tmp_path / "nvme", device="cpu") as kv:
        cache = TieredCache(kv, model, prompt=prompt)
        not_causal = torch.zeros(1, 1, 20, 20)  # every token sees every other: refused before anything is stored
        with pytest.raises(UserError, match="not causal"), torch.no_grad():
            model(inputs_embeds=model.get_input_embeddings()(prompt), attention_mask=not_causal, cache=cache)
        assert cache.get_seq_length() == 0
        model.generate(prompt, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
        cache.free()
        again = TieredCache(kv, model, prompt=prompt)
        assert again.cached_tokens == 16
        again.free()
