"""Probe q19 (the ``transformers`` drop-in cache): ``reorder_cache`` truncated float and bool
index tensors into other rows (``[0.9, 0.2]`` freed row 1 and forked row 0 in its place) and
met a 2-D index with a bare ``TypeError``; an id beyond int64 in a prompt of one row was
reported as "rows differ in length"."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the transformers cache needs the hf extra (pip install -e '.[hf]')")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiercache import TieredKVCache  # noqa: E402
from tiercache.config import TierConfig  # noqa: E402
from tiercache.errors import UserError  # noqa: E402
from tiercache.integrations.transformers import TieredCache, kv_layout, match_prefix, use_tiercache  # noqa: E402


def _model() -> LlamaForCausalLM:
    torch.manual_seed(19)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return use_tiercache(LlamaForCausalLM(config).eval())


def _tiered(model, tmp_path) -> TieredKVCache:
    tiers = [TierConfig("hbm", 8), TierConfig("dram", 8), TierConfig("nvme", 64)]
    return TieredKVCache(kv_layout(model.config, torch.float32, 4), tiers, path=tmp_path / "nvme", device="cpu")


def _two_rows(model, kv) -> TieredCache:
    cache = TieredCache(kv, model)
    with torch.no_grad():
        model(torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(2)), cache=cache)
    return cache


def test_a_row_order_of_floats_or_bools_is_refused_naming_its_dtype_and_keeps_every_row(tmp_path):
    model = _model()
    with _tiered(model, tmp_path) as kv:
        cache = _two_rows(model, kv)
        rows = list(cache.sequences)
        for order, dtype in ((torch.tensor([0.9, 0.2]), "torch.float32"), (torch.tensor([True, False]), "torch.bool"),
                             (torch.tensor([1, 0], dtype=torch.float16), "torch.float16"),
                             (np.array([1.0, 0.0]), "float64"), ([True, False], "bool"), ([1, 0.0], "float64")):
            with pytest.raises(UserError, match=f"^TieredCache: row order must hold integer row indices, got dtype {dtype}$"):
                cache.reorder_cache(order)
        assert cache.sequences == rows and not any(seq.freed for seq in rows)
        cache.reorder_cache(np.array([1, 0], dtype=np.uint8))  # any integer dtype is taken
        assert cache.sequences == rows[::-1]
        cache.free()
        assert not kv.manager.held


def test_a_row_order_that_is_not_1d_is_refused_naming_its_shape(tmp_path):
    model = _model()
    with _tiered(model, tmp_path) as kv:
        cache = _two_rows(model, kv)
        rows = list(cache.sequences)
        for order, shape in ((torch.tensor([[0], [1]]), r"\(2, 1\)"), (torch.tensor(1), r"\(\)"), ([[1, 0]], r"\(1, 2\)")):
            with pytest.raises(UserError, match=f"^TieredCache: row order must be 1-D \\(one source row per row\\), got shape {shape}$"):
                cache.reorder_cache(order)
        assert cache.sequences == rows
        cache.free()


def test_an_id_beyond_int64_is_named_as_such_and_not_as_rows_of_different_lengths(tmp_path):
    model = _model()
    with _tiered(model, tmp_path) as kv:
        for call in (lambda: match_prefix(kv, model, [2**70]), lambda: match_prefix(kv, model, [[1, 2**70]]),
                     lambda: TieredCache(kv, model, prompt=[[1, 2**70]]),
                     lambda: TieredCache(kv, model, prompt=[[1, 2**70], [3, 4]])):
            with pytest.raises(UserError, match=r"a token id does not fit in int64$"):
                call()
        with pytest.raises(UserError, match=r"^match_prefix: tokens rows differ in length; call match_prefix once per row$"):
            match_prefix(kv, model, [[1, 2**70], [3]])  # rows that do differ still say so
        with pytest.raises(UserError, match=r"^TieredCache: prompt rows differ in length"):
            TieredCache(kv, model, prompt=[[1, 2], [3]])
        assert not kv.manager.held
