"""Probe Q53: an NVMe store reopened under another model of the same shape.

``zarr.json`` recorded the layout's shape but not its model (``KVLayout.name``), so a store
written under llama-3-8b reopened under mistral-7b (same layers, heads, head dim, dtype)
matched llama's prompt and served llama's KV to mistral. The remote tier already tags values
with the name. The store now records the model and refuses another, naming both; a store
written before the attribute opens under any name.
"""

from __future__ import annotations

import json

import pytest
import torch

from tiercache import TieredKVStore
from tiercache.config import KVLayout, TierConfig
from tiercache.errors import UserError

TIERS = [TierConfig("hbm", 2), TierConfig("nvme", 8)]


def _layout(name: str) -> KVLayout:
    return KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float16", block_tokens=4, name=name)


def _write(path, name: str) -> torch.Tensor:
    kv = torch.randn(2, *_layout(name).block_shape).half()
    with TieredKVStore(_layout(name), TIERS, path=path, device="cpu") as store:
        store.put([b"a" * 16, b"b" * 16], kv)
    return kv


def test_another_models_layout_of_the_same_shape_is_refused(tmp_path):
    _write(tmp_path, "model-a")
    with pytest.raises(UserError, match="store holds KV of model 'model-a', asked for model 'model-b'"):
        TieredKVStore(_layout("model-b"), TIERS, path=tmp_path, device="cpu")
    with TieredKVStore(_layout("model-a"), TIERS, path=tmp_path, device="cpu") as store:
        assert store.lookup([b"a" * 16, b"b" * 16])[0] == 2


def test_a_store_written_before_the_model_was_recorded_opens_under_any_name(tmp_path):
    kv = _write(tmp_path, "model-a")
    meta = tmp_path / "zarr.json"
    doc = json.loads(meta.read_text())
    attrs = next(v for v in doc["attributes"].values() if isinstance(v, dict) and "layout" in v)
    del attrs["model"]
    meta.write_text(json.dumps(doc))
    with TieredKVStore(_layout("model-b"), TIERS, path=tmp_path, device="cpu") as store:
        assert torch.equal(store.get([b"a" * 16, b"b" * 16]), kv)


def test_a_path_without_an_nvme_tier_warns_that_nothing_is_stored_there(tmp_path):
    """Probe Q53: ``path=`` given with no NVMe tier was ignored silently (a user expecting the
    blocks to persist lost them at close)."""
    with pytest.warns(UserWarning, match="no tier is nvme: nothing is stored there"):
        store = TieredKVStore(_layout("model-a"), [TierConfig("hbm", 2), TierConfig("dram", 2)], path=tmp_path,
                              device="cpu")
    store.close()
