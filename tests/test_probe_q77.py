"""Probe Q77 findings (generate, the decode loop, raw attention and prefix reuse all matched
their references; these are the API inconsistencies it found):

- Q77-2: ``TieredKVStore.put_tokens`` / ``match_prefix`` refused an ``input_ids`` tensor of one
  row (``[1, n]``), which the decode cache and the ``transformers`` integration take.
- Q77-3: ``KVLayout`` refused numpy integers (accepted elsewhere: crop, layers, budgets) and
  torch dtypes (``kv_layout`` takes them), the latter as an "unknown dtype".
(Q77-1 was the README's decode-loop example, which appended the whole prompt after reusing a
stored prefix; it now appends from ``seq.cached_tokens``.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiercache.config import KVLayout, TierConfig
from tiercache.errors import ConfigError, UserError
from tiercache.live.store import TieredKVStore

LAYOUT = KVLayout(layers=1, kv_heads=1, head_dim=4, dtype="float32", block_tokens=4)


@pytest.fixture
def store():
    with TieredKVStore(LAYOUT, [TierConfig("hbm", 8)], device="cpu") as opened:
        yield opened


def test_the_store_takes_token_ids_as_one_row_of_input_ids(store):
    prompt = list(range(10))
    data = torch.randn(2, *LAYOUT.block_shape)
    assert store.put_tokens(torch.tensor([prompt]), data) == 2
    for ids in (prompt, torch.tensor(prompt), torch.tensor([prompt]), np.array([prompt])):
        assert store.match_prefix(ids) == 8
    assert store.put_tokens(np.array(prompt), data) == 0  # the same blocks, by the same keys


def test_the_store_refuses_a_batch_of_token_ids_naming_the_method(store):
    with pytest.raises(UserError, match=r"TieredKVStore.match_prefix: one sequence's ids .* shape \(2, 8\)"):
        store.match_prefix(torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(UserError, match="TieredKVStore.put_tokens: one sequence"):
        store.put_tokens(torch.zeros(2, 8, dtype=torch.long), torch.randn(2, *LAYOUT.block_shape))
    assert store.match_prefix([0] * 8) == 0  # the refused put stored nothing


def test_a_layout_takes_numpy_integers_and_torch_dtypes_as_their_plain_values():
    layout = KVLayout(layers=np.int64(2), kv_heads=np.int32(2), head_dim=np.uint8(8), dtype=torch.float16,
                      block_tokens=np.int16(4))
    assert layout == KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
    assert type(layout.layers) is int and type(layout.block_tokens) is int and layout.dtype == "float16"


@pytest.mark.parametrize("field, value", [("layers", np.bool_(True)), ("layers", 2.0), ("head_dim", np.float32(8)),
                                          ("dtype", torch.int32), ("dtype", 16)])
def test_a_layout_still_refuses_what_is_not_a_positive_integer_or_a_known_dtype(field, value):
    with pytest.raises(ConfigError, match=f"KVLayout.{field}"):
        KVLayout(**({"layers": 2, "kv_heads": 2, "head_dim": 8} | {field: value}))
