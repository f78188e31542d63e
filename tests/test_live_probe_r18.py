"""Review R18 findings 3 and 4 on the live store. (3) A ``put`` of a block the caller just
computed that a lower tier still held only touched it there, so the next request read it back
from NVMe although the put had its bytes; README's prefix model (and the manager's
``_recompute_below``) moves such a block to the top tier without a load. (4) ``get_slots``
that raised because a block could not be brought to HBM still counted a hit read in place and
charged its bytes on ``nvme->hbm``, a read that never happened."""

from __future__ import annotations

import pytest
import torch

from store_helpers import LAYOUT, blocks, key, tiers
from tiercache.live.store import TieredKVStore


def _filled(tmp_path, n: int, **capacities) -> tuple[TieredKVStore, torch.Tensor, list]:
    """An LRU store of ``capacities`` holding ``n`` blocks, put one at a time (the first ones
    pushed lowest), with their data and keys."""
    data, keys = blocks(n, n // 3), [key(i) for i in range(n)]
    store = TieredKVStore(LAYOUT, tiers(**capacities), eviction="lru", path=tmp_path / "nvme", device="cpu")
    for i in range(n):
        store.put([keys[i]], data[i : i + 1])
    return store, data, keys


def test_a_put_of_a_block_a_lower_tier_holds_stores_it_in_hbm_from_its_bytes_with_no_load_and_no_count(tmp_path):
    store, data, keys = _filled(tmp_path, 6, hbm=2, dram=2, nvme=4)
    with store:
        assert store.lookup(keys)[1] == ["nvme", "nvme", "dram", "dram", "hbm", "hbm"]
        before = store.stats()
        assert store.put([keys[0], keys[5]], data[[0, 5]]) == 0  # both stored already: refreshed
        after = store.stats()
        # keys[0] is stored in HBM from the put's bytes; keys[5], in HBM already, is only touched
        assert store.lookup(keys)[1] == ["hbm", "nvme", "nvme", "dram", "dram", "hbm"]
        assert after["nvme"]["gets"] == before["nvme"]["gets"] and "nvme->hbm" not in after["bytes_moved"]
        assert (after["hits"], after["misses"], after["refreshes"]) == (before["hits"], before["misses"], before["refreshes"] + 2)
        assert [t["inserts"] for t in after["tiers"]] == [t["inserts"] for t in before["tiers"]]  # no block entered
        assert after["tiers"][0]["hits"] == before["tiers"][0]["hits"]
        gets = after["nvme"]["gets"]
        assert torch.equal(store.get([keys[0]]), data[:1])  # the next request finds it in HBM
        assert store.stats()["nvme"]["gets"] == gets
        assert torch.equal(store.get(keys), data)  # one copy of each block, every one intact
        store.check_invariants()


def test_get_slots_that_cannot_bring_a_stored_block_to_hbm_counts_and_charges_nothing_for_it(tmp_path):
    store, data, keys = _filled(tmp_path, 3, hbm=1, dram=1, nvme=4)
    with store:
        assert store.lookup(keys)[1] == ["nvme", "dram", "hbm"]
        store.pin([keys[2]])  # the one HBM slot pinned: no room can be made there
        before = store.stats()
        for asked in ([keys[0]], [keys[2], keys[1]]):
            with pytest.raises(KeyError, match="could not be brought to HBM"):
                store.get_slots(asked)
        after = store.stats()
        assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])  # none was read
        assert [t["hits"] for t in after["tiers"]] == [t["hits"] for t in before["tiers"]]
        assert [t["hits_in_place"] for t in after["tiers"]] == [0, 0, 0]
        assert after["bytes_moved"] == before["bytes_moved"] and after["nvme"]["gets"] == before["nvme"]["gets"]
        store.release([keys[2]])
        assert len(store.get_slots([keys[0]])) == 1  # a get_slots that succeeds counts its hit
        assert store.stats()["hits"] == before["hits"] + 1
        store.check_invariants()
