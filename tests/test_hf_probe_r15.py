"""Probe R15, finding 5 (the ``transformers`` drop-in cache): ``reorder_cache`` refused bool
tensors and all-bool lists, but a Python list mixing ints and bools (``[1, True]``,
``[True, 0]``) went through ``np.asarray`` as int64 and reordered the rows as ``[1, 1]`` /
``[1, 0]``, where transformers' ``index_select`` refuses a bool index."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the transformers cache needs the hf extra (pip install -e '.[hf]')")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tiercache import TieredKVCache  # noqa: E402
from tiercache.config import TierConfig  # noqa: E402
from tiercache.errors import UserError  # noqa: E402
from tiercache.integrations.transformers import TieredCache, kv_layout, use_tiercache  # noqa: E402


def test_a_bool_among_the_ints_of_a_row_order_list_is_refused_naming_its_position_and_no_row_changes(tmp_path):
    torch.manual_seed(15)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = use_tiercache(LlamaForCausalLM(config).eval())
    tiers = [TierConfig("hbm", 8), TierConfig("dram", 8), TierConfig("nvme", 64)]
    with TieredKVCache(kv_layout(model.config, torch.float32, 4), tiers, path=tmp_path / "nvme", device="cpu") as kv:
        cache = TieredCache(kv, model)
        with torch.no_grad():
            model(torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(2)), cache=cache)
        rows = list(cache.sequences)
        for order, position, shown in (([1, True], 1, "True"), ([True, 0], 0, "True"), ((0, False), 1, "False"),
                                       ([np.True_, 0], 0, repr(np.True_)), ([1, torch.tensor(False)], 1, "tensor(False)")):
            with pytest.raises(UserError, match=rf"^TieredCache: row order must hold integer row indices, got a bool "
                                                rf"\({re.escape(shown)}\) at position {position}$"):
                cache.reorder_cache(order)
        assert cache.sequences == rows and not any(seq.freed for seq in rows)
        cache.reorder_cache([1, np.int64(0)])  # integers of any kind still reorder
        assert cache.sequences == rows[::-1]
        cache.free()
        assert not kv.manager.held
