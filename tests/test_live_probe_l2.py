"""Probe L findings on the live API, second round: an append whose new blocks pushed out its
own already-stored block (``StepDriver.write`` held it too late), ``put``'s count of new blocks
stored, and misuse errors that named an internal id, raised the wrong error, or were not
raised at all on a closed store."""

from __future__ import annotations

import pytest
import torch

from store_helpers import LAYOUT, blocks, key, tiers
from tiercache.config import KVLayout, TierConfig
from tiercache.core.decode import StepDriver
from tiercache.core.manager import TierManager
from tiercache.errors import UserError
from tiercache.live.cache import TieredKVCache
from tiercache.live.store import TieredKVStore
from tiercache.policies import make_admission, make_eviction, make_prefetch

SEQ_LAYOUT = KVLayout(layers=1, kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
PROMPT = list(range(13))  # three full blocks and one token


def four_block_cache(tmp_path, write_through: bool = False) -> TieredKVCache:
    """Four blocks of one layer in all: HBM 1, DRAM 1 and NVMe 2, or NVMe 4 in an inclusive
    hierarchy (whose last tier bounds it)."""
    tier_list = [TierConfig("hbm", 1), TierConfig("dram", 1), TierConfig("nvme", 4 if write_through else 2)]
    return TieredKVCache(SEQ_LAYOUT, tier_list, eviction="lru", path=tmp_path / "nvme", device="cpu",
                         write_through=write_through)


def kv(tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, tokens, 8, generator=gen).half()


def prompt_with_only_its_last_block_stored(cache: TieredKVCache) -> None:
    """Stores the prompt's three blocks, then three private ones: the prompt's first two leave
    (LRU-oldest), its third stays, the oldest block left in the hierarchy."""
    first = cache.sequence(tokens=PROMPT)
    first.append(0, kv(13, 1), kv(13, 2))
    first.free()
    other = cache.sequence()
    other.append(0, kv(12, 3), kv(12, 4))
    other.free()
    assert cache.match_prefix(PROMPT) == 0 and not cache.manager.held


# -- Sequence.append / StepDriver.write ------------------------------------------------------
@pytest.mark.filterwarnings("ignore::tiercache.live.lifecycle.PersistWarning")  # a tiny NVMe tier: close keeps what fits, says so
@pytest.mark.parametrize("write_through", [False, True])
def test_an_append_that_fits_stores_and_holds_its_blocks_when_they_push_out_its_own_stored_block(tmp_path, write_through):
    with four_block_cache(tmp_path, write_through) as cache:
        prompt_with_only_its_last_block_stored(cache)
        seq = cache.sequence(tokens=PROMPT)
        assert seq.cached_tokens == 0
        seq.append(0, kv(13, 5), kv(13, 6))  # 3 blocks (two new, one stored) of 4: fits
        assert seq.length(0) == 13
        ids = [int(i) for i in seq._layers[0].ids[: seq.blocks(0)]]
        assert len(ids) == 3 and all(cache.manager.locate(i) is not None for i in ids)
        assert dict(cache.manager.held) == {i: 1 for i in ids}
        seq.free()
        assert not cache.manager.held
        cache.check_invariants()


def test_a_write_holds_its_stored_blocks_before_its_new_ones_can_push_them_out():
    names = [("hbm", 1), ("dram", 1), ("nvme", 2)]
    manager = TierManager(names, [make_eviction("lru", c) for _, c in names], [make_admission("always") for _ in names])
    driver = StepDriver(manager, make_prefetch("none"))
    driver.write([10, 11, 12])
    driver.write([20, 21, 22])  # 10 and 11 leave; 12 is the oldest block left, on NVMe
    assert [manager.locate(i) for i in (10, 11, 12)] == [None, None, 2]
    assert driver.write([10, 11, 12], hold=[10, 11, 12]) == [10, 11]
    assert all(manager.locate(i) is not None for i in (10, 11, 12))
    assert dict(manager.held) == {10: 1, 11: 1, 12: 1}
    manager.check_invariants()


@pytest.mark.filterwarnings("ignore::tiercache.live.lifecycle.PersistWarning")  # a tiny NVMe tier: close keeps what fits, says so
def test_an_append_whose_insert_fails_takes_back_the_holds_on_its_stored_blocks(tmp_path, monkeypatch):
    with four_block_cache(tmp_path) as cache:
        prompt_with_only_its_last_block_stored(cache)
        seq = cache.sequence(tokens=PROMPT)

        def failing(*args, **kwargs):
            raise RuntimeError("injected")

        monkeypatch.setattr(cache.manager, "insert", failing)  # after the stored block is held
        with pytest.raises(RuntimeError, match="injected"):
            seq.append(0, kv(13, 5), kv(13, 6))
        monkeypatch.undo()
        assert seq.length(0) == 0 and not cache.manager.held
        seq.append(0, kv(13, 5), kv(13, 6))
        assert seq.length(0) == 13 and len(cache.manager.held) == 3
        seq.free()
        cache.check_invariants()


# -- put's count ------------------------------------------------------------------------------
def test_put_counts_only_the_new_blocks_still_stored_when_it_returns(tmp_path):
    with TieredKVStore(LAYOUT, tiers(1, 1, 1), eviction="lru", path=tmp_path / "nvme") as store:
        store.put([key(i) for i in range(3)], blocks(3, 0))
        keys = [key(0), key(3), key(4), key(5)]  # one stored key, three new ones (three slots in all)
        stored = store.put(keys, blocks(4, 1))
        where = store.lookup(keys)[1]
        assert stored == sum(tier is not None for tier in where[1:])
        store.check_invariants()


# -- misuse errors ----------------------------------------------------------------------------
def test_get_slots_and_release_of_an_unknown_key_raise_keyerror_naming_the_key(tmp_path):
    with TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme") as store:
        store.put([key(1)], blocks(1, 0))
        unknown = key(999).hex()
        with pytest.raises(KeyError, match=f"TieredKVStore.get_slots: key {unknown} is not stored"):
            store.get_slots([key(1), key(999)])
        with pytest.raises(KeyError, match=f"TieredKVStore.release: key {unknown} is not stored"):
            store.release([key(999)])
        store.pin([key(1)])
        with pytest.raises(KeyError, match="release"):  # the whole call changes nothing
            store.release([key(1), key(999)])
        store.release([key(1)])
        assert not store.manager.refs


def test_a_pinned_block_lost_since_is_still_released(tmp_path):
    with TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme") as store:
        store.put([key(1)], blocks(1, 0))
        store.pin([key(1)])
        block_id = store._map.ids([key(1)], register=False)[0]
        store._drop_unreadable(store.manager.locate(block_id), block_id)  # found corrupt while pinned
        assert store.lookup([key(1)]) == (0, [None])
        store.release([key(1)])
        assert not store.manager.refs and not store.manager.orphan_refs
        store.check_invariants()


@pytest.mark.parametrize("call", ["wait", "poll", "check_invariants", "hbm_tensor"])
def test_a_closed_store_refuses_every_call(tmp_path, call):
    store = TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme")
    store.put([key(1)], blocks(1, 0))
    store.close()
    with pytest.raises(UserError, match="the store is closed"):
        attribute = getattr(store, call)  # hbm_tensor is a property: refused when read
        attribute()


@pytest.mark.parametrize("wait", ["no", 0, None])
def test_access_refuses_a_wait_that_is_not_a_bool(tmp_path, wait):
    with TieredKVStore(LAYOUT, tiers(), path=tmp_path / "nvme") as store:
        with pytest.raises(UserError, match="TieredKVStore.access: wait must be True or False"):
            store.access([key(1)], blocks(1, 0), wait=wait)
        assert store.lookup([key(1)]) == (0, [None])
