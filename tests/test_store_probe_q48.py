"""Probe q48 (the Python API called in hostile orders): ``get_slots`` and ``prefetch`` bring
blocks to HBM while DRAM is full of them (or pinned) and NVMe has room (the HBM victims pass
DRAM; they were declined: a KeyError for a stored block, a prefetch that moved nothing); a
plain ``get`` and the replay still read such a run in place; a handle another store returned,
and a ``TieredCache`` over a closed ``TieredKVCache``, are refused."""

from __future__ import annotations

import tempfile

import pytest
import torch

from store_helpers import LAYOUT, blocks, key, tiers
from tiercache import TieredKVStore
from tiercache.errors import UserError


def where(store: TieredKVStore, keys: list[bytes]) -> list[str | None]:
    return store.lookup(keys)[1]


def full_store(hbm: int, dram: int) -> tuple[TieredKVStore, list[bytes], torch.Tensor]:
    """HBM and DRAM full (DRAM holds the first ``dram`` keys, HBM the rest), NVMe empty."""
    store = TieredKVStore(LAYOUT, tiers(hbm, dram, 16), path=tempfile.mkdtemp(), device="cpu")
    keys, kv = [key(i) for i in range(hbm + dram)], blocks(hbm + dram, seed=48)
    store.put(keys, kv)
    store.wait()
    assert where(store, keys) == ["dram"] * dram + ["hbm"] * hbm
    return store, keys, kv


@pytest.mark.parametrize("hbm, dram, wanted", [(1, 1, 1), (2, 2, 2)])
def test_get_slots_passes_a_dram_full_of_the_run_to_nvme(hbm, dram, wanted):
    store, keys, kv = full_store(hbm, dram)
    with store:
        slots = store.get_slots(keys[:wanted])
        assert where(store, keys[:wanted]) == ["hbm"] * wanted
        assert torch.equal(store.hbm_tensor[slots], kv[:wanted])
        assert "nvme" in where(store, keys)  # an HBM victim went past DRAM, none left the store
        assert torch.equal(store.get(keys), kv)
        store.check_invariants()


def test_get_slots_passes_a_dram_of_pinned_blocks():
    store, keys, kv = full_store(2, 2)
    with store:
        store.pin(keys[:2])  # DRAM all pinned: the HBM victim may not go there
        store.get_slots(keys[:1])
        assert where(store, keys[:2]) == ["hbm", "dram"]
        store.release(keys[:2])
        assert torch.equal(store.get(keys), kv)


def test_a_prefetch_moves_the_run_and_a_plain_get_still_reads_it_in_place():
    store, keys, kv = full_store(2, 2)
    with store:
        store.wait(store.prefetch(keys[:2]))
        assert where(store, keys) == ["hbm", "hbm", "nvme", "nvme"]
        assert store.stats()["tiers"][1]["promote_skipped"] == 0
    store, keys, kv = full_store(2, 2)
    with store:  # a plain get keeps the replay's rule: the run is read where it lies
        assert torch.equal(store.get(keys[:2]), kv[:2])
        assert where(store, keys) == ["dram", "dram", "hbm", "hbm"]


def test_a_prefetch_with_less_room_below_than_its_run_moves_what_fits():
    """NVMe with one free slot for a run of two (review r28: the piece was not cut to the
    free slots, and nothing moved while a full NVMe let everything move)."""
    store = TieredKVStore(LAYOUT, tiers(2, 2, 4), path=tempfile.mkdtemp(), device="cpu")
    keys, kv = [key(i) for i in range(7)], blocks(7, seed=28)
    with store:
        store.put(keys, kv)
        store.wait()
        assert where(store, keys) == ["nvme"] * 3 + ["dram"] * 2 + ["hbm"] * 2
        store.wait(store.prefetch(keys[3:5]))
        assert where(store, keys[3:5]).count("hbm") == 1 and None not in where(store, keys)
        assert store.stats()["tiers"][1]["promote_skipped"] == 1  # the second waits for the first to land
        assert torch.equal(store.get(keys), kv)
        store.check_invariants()


def test_a_handle_from_another_store_is_refused_and_still_copies():
    import copy
    import pickle

    with full_store(2, 2)[0] as a, full_store(2, 2)[0] as b:
        pending = a.prefetch([key(0)])
        with pytest.raises(UserError, match="not made by this store"):
            b.wait(pending)
        a.wait(copy.deepcopy(pickle.loads(pickle.dumps(pending))))  # a plain value: its owner is a token
        b.wait(type(pending)())  # an empty handle made by hand waits on nothing


def test_a_tiered_cache_over_a_closed_kv_cache_is_refused(tmp_path):
    pytest.importorskip("transformers")
    from test_hf_cache import tiered, tiny_llama
    from tiercache.integrations.transformers import TieredCache, use_tiercache

    model = use_tiercache(tiny_llama(seed=48))
    kv = tiered(model, tmp_path)
    kv.close()
    with pytest.raises(UserError, match="closed"):
        TieredCache(kv, model)
