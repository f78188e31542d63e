"""Probe Q36 (the Python API fed wrong types): keys of a ``bytes`` subclass (``numpy.bytes_``)
were accepted, then refused by the NVMe tier inside every move down (blocks stuck in DRAM,
later puts storing nothing, a PersistError at close); a relative ``path=`` stayed relative, so
after ``os.chdir`` every NVMe write failed and blocks were lost; a sparse tensor reached torch
internals; a policy name that was no str, ``write_through="yes"`` and ``record=<fd>`` were
taken as they came (the last wrote the trace into the caller's file and closed it); odd
``KVLayout``/``RemoteConfig`` field types passed; a freed sequence took ``add_tokens``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from store_helpers import LAYOUT, blocks, key, tiers
from tiercache import TieredKVCache
from tiercache.config import ConfigError, KVLayout, TierConfig
from tiercache.errors import UserError
from tiercache.live.store import TieredKVStore
from tiercache.policies import PolicyError
from tiercache.remote_config import RemoteConfig


def _all_back(store: TieredKVStore, keys: list, data: torch.Tensor) -> None:
    store.check_invariants()
    assert all(tier is not None for tier in store.lookup(keys)[1])
    assert torch.equal(store.get(keys), data)


def test_keys_of_a_bytes_subclass_are_stored_as_bytes_and_move_down_to_nvme(tmp_path):
    class Key(bytes):
        pass

    path, data = tmp_path / "nvme", blocks(12, 1)
    keys = [np.bytes_(key(i)) for i in range(6)] + [Key(key(i)) for i in range(6, 12)]
    with TieredKVStore(LAYOUT, tiers(), path=path) as store:
        assert store.put(keys, data) == 12  # 2 + 3 held above, the rest moved down to NVMe
        assert store.stats()["tiers"][1]["failed_transfers"] == 0
        _all_back(store, [key(i) for i in range(12)], data)
    with TieredKVStore(LAYOUT, tiers(), path=path) as again:
        _all_back(again, [key(i) for i in range(12)], data)


def test_a_relative_store_path_survives_a_change_of_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = blocks(8, 2)
    store = TieredKVStore(LAYOUT, tiers(hbm=1, dram=1), path="relative store")
    monkeypatch.chdir("/")
    assert store.put([key(i) for i in range(8)], data) == 8
    assert store.close() == 2
    with TieredKVStore(LAYOUT, tiers(hbm=1, dram=1), path=tmp_path / "relative store") as again:
        _all_back(again, [key(i) for i in range(8)], data)


def test_an_empty_store_path_is_refused():
    with pytest.raises(UserError, match="path is empty"):
        TieredKVStore(LAYOUT, tiers(), path="")


def test_a_sparse_tensor_is_refused_before_any_key_is_registered(tmp_path):
    data = blocks(2, 3)
    with TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme") as store:
        with pytest.raises(UserError, match=r"TieredKVStore.put kv_blocks: expected a dense tensor, got layout sparse_coo"):
            store.put([key(0), key(1)], data.to_sparse())
        store.check_invariants()
        assert store.put([key(0), key(1)], data) == 2
        _all_back(store, [key(0), key(1)], data)


@pytest.mark.parametrize("option", ["eviction", "admission"])
def test_a_policy_that_is_not_a_name_is_refused_naming_its_kind(tmp_path, option):
    kind = "eviction" if option == "eviction" else "admission"
    with pytest.raises(PolicyError, match=rf"^{kind} policy must be a name \(a str\), got int 5; known: "):
        TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme", **{option: 5})


def test_write_through_must_be_a_bool(tmp_path):
    with pytest.raises(UserError, match=r"write_through must be True or False, got str 'yes'"):
        TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme", write_through="yes")
    with TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme", write_through=np.True_) as store:
        assert store.manager.write_through is True


def _cache_layout() -> KVLayout:
    return KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float32", block_tokens=4)


def test_a_record_that_is_a_file_descriptor_is_refused_and_the_callers_file_kept(tmp_path):
    victim = tmp_path / "victim.txt"
    with open(victim, "w") as file:
        file.write("mine\n")
        file.flush()
        with pytest.raises(UserError, match=r"record must be a path \(str or os.PathLike\), got int"):
            TieredKVCache(_cache_layout(), [TierConfig("hbm", 8)], device="cpu", record=file.fileno())
        file.write("still mine\n")  # the descriptor was not closed
    assert victim.read_text() == "mine\nstill mine\n"


def test_a_freed_sequence_refuses_add_tokens(tmp_path):
    with TieredKVCache(_cache_layout(), [TierConfig("hbm", 8)], device="cpu") as cache:
        seq = cache.sequence()
        seq.free()
        with pytest.raises(UserError, match="Sequence.add_tokens: the sequence was freed"):
            seq.add_tokens([1, 2])


@pytest.mark.parametrize("field, value", [("per_layer", "yes"), ("per_layer", 1), ("name", 5)])
def test_kv_layout_refuses_fields_of_the_wrong_type(field, value):
    with pytest.raises(ConfigError, match=rf"KVLayout.{field}: must be"):
        KVLayout(layers=2, kv_heads=2, head_dim=8, **{field: value})


@pytest.mark.parametrize("field, value", [("protocol", 5), ("local_host", None), ("device", 0), ("protocol", "")])
def test_remote_config_refuses_fields_of_the_wrong_type(field, value):
    with pytest.raises(ConfigError, match="RemoteConfig"):
        RemoteConfig("127.0.0.1:5000", "http://127.0.0.1:5001/metadata", **{field: value})
