"""Probe Q26 findings on the live store's API contract: an ``out=`` whose blocks share memory
(``expand``) or that lies in the store's own pool memory (a slice of ``hbm_tensor``) returned
wrong data or overwrote stored blocks; ``stats()`` counted no read's misses and every block a
``put`` found already stored as a hit; and that refresh was charged as an NVMe read that never
happened."""

from __future__ import annotations

import pytest
import torch

from store_helpers import LAYOUT, blocks, key, tiers
from tiercache.errors import UserError
from tiercache.keys import prefix_keys
from tiercache.live.store import TieredKVStore

BT = LAYOUT.block_tokens


def _reads(store: TieredKVStore) -> tuple:
    """What a read changes: the hits and misses, bytes per link and NVMe reads."""
    stats = store.stats()
    return stats["hits"], stats["misses"], stats["bytes_moved"], stats["nvme"]["gets"], [t["hits"] for t in stats["tiers"]]


@pytest.mark.parametrize("hbm", [8, 1])  # every block in HBM (one gather), or spread over the tiers (block by block)
def test_an_out_sharing_memory_or_lying_in_a_store_pool_is_refused_before_anything_is_read(tmp_path, hbm):
    data = blocks(6, 1)
    keys = [key(i) for i in range(6)]
    with TieredKVStore(LAYOUT, tiers(hbm=hbm, dram=2, nvme=16), path=tmp_path / "nvme", device="cpu") as store:
        store.put(keys, data)
        before = _reads(store)
        expanded = torch.empty(1, *LAYOUT.block_shape, dtype=torch.float16).expand(4, *LAYOUT.block_shape)
        with pytest.raises(UserError, match=r"TieredKVStore\.get out: its elements share \(or may share\) memory"):
            store.get(keys[:4], out=expanded)
        with pytest.raises(UserError, match=r"get_prefix out: its elements share"):
            store.get_prefix(keys[:4], out=expanded)
        in_pool = store.hbm_tensor[:1]
        with pytest.raises(UserError, match=r"get out: it lies in the memory of the store's hbm pool \(hbm_tensor\)"):
            store.get(keys[5:], out=in_pool)
        dram = store._media[1].tensor[:1]
        with pytest.raises(UserError, match=r"get_prefix out: it lies in the memory of the store's dram pool"):
            store.get_prefix(keys[5:], out=dram)
        assert _reads(store) == before  # refused before anything was looked up, read or counted
        strided = torch.empty(6, *LAYOUT.block_shape[:-1], 2 * LAYOUT.head_dim, dtype=torch.float16)[..., ::2]
        assert torch.equal(store.get(keys, out=strided), data) and torch.equal(strided, data)  # a strided view is fine
        assert torch.equal(store.get(keys), data)  # every stored block still holds its own bytes
        store.check_invariants()


def test_hits_and_misses_count_every_block_a_read_asks_for_and_lookups_give_the_prefix_hit_ratio(tmp_path):
    """A serving loop (match_prefix, get_prefix of the reused part, put_tokens of the prompt) reuses
    12 blocks and computes 20: its lookups say so, each reused block is one read hit (a put of a
    stored block is a refresh, not a hit), and reads count the blocks they could not serve."""
    shared = list(range(4 * BT))
    with TieredKVStore(LAYOUT, tiers(hbm=8, dram=8, nvme=64), path=tmp_path / "nvme", device="cpu") as store:
        for r in range(4):
            prompt = shared + [1000 + 16 * r + i for i in range(4 * BT)]
            keys = prefix_keys(prompt, BT)
            found = store.match_prefix(prompt) // BT
            assert len(store.get_prefix(keys[:found])) == found  # reuse the stored KV
            store.put_tokens(prompt, blocks(len(keys), r))
        stats = store.stats()
        assert stats["lookups"] == {"calls": 4, "hits": 12, "misses": 20}  # 38%: the prefix-cache hit ratio
        assert (stats["hits"], stats["misses"], stats["refreshes"]) == (12, 0, 12)  # each reused block read once
        assert stats["hits"] == sum(t["hits"] for t in stats["tiers"])
        present, absent = prefix_keys(shared, BT), [key(900 + i) for i in range(3)]
        with pytest.raises(KeyError):
            store.get([present[0], absent[0], absent[1]])
        assert store.stats()["misses"] == 2  # the two absent keys, before it raised
        assert len(store.get_prefix([present[0], absent[0], present[1]])) == 1
        assert (store.stats()["hits"], store.stats()["misses"]) == (13, 4)  # every block past the prefix is a miss
        with pytest.raises(KeyError):
            store.get_slots([absent[2]])
        assert store.stats()["misses"] == 5
        assert store.lookup(absent + present)[0] == 0 and store.stats()["lookups"]["misses"] == 20 + 7
        store.check_invariants()


def test_a_put_refreshing_a_block_on_nvme_reads_nothing_and_is_charged_nothing(tmp_path):
    """A refresh reads nothing from NVMe: with no room in HBM the block stays where it lies,
    touched; with room it is stored in HBM from the put's own bytes (review R18: as a
    recomputed block moves up in a replay's prefix semantics), no NVMe read charged."""
    data = blocks(5, 2)
    keys = [key(i) for i in range(5)]
    with TieredKVStore(LAYOUT, tiers(hbm=1, dram=1, nvme=2), eviction="lru", path=tmp_path / "nvme", device="cpu") as store:
        for i in range(4):
            store.put([keys[i]], data[i : i + 1])
        assert store.lookup(keys[:4])[1] == ["nvme", "nvme", "dram", "hbm"]
        store.pin([keys[3]])  # the one HBM slot pinned: no room can be made there
        before = store.stats()
        assert store.put([keys[1]], data[1:2]) == 0  # stored already: refreshed where it lies
        assert store.stats()["bytes_moved"] == before["bytes_moved"] and store.stats()["tiers"] == before["tiers"]
        store.release([keys[3]])
        assert store.put([keys[0]], data[:1]) == 0  # room can be made now: stored in HBM from these bytes
        after = store.stats()
        assert after["nvme"]["gets"] == before["nvme"]["gets"] and "nvme->hbm" not in after["bytes_moved"]
        assert (after["hits"], after["refreshes"]) == (before["hits"], before["refreshes"] + 2)
        assert [t["hits_in_place"] for t in after["tiers"]] == [t["hits_in_place"] for t in before["tiers"]]
        # room in HBM is made before keys[0] leaves NVMe (as for a promotion): the full hierarchy
        # pushes out NVMe's least recent block, keys[1]; keys[0]'s NVMe slot is then free
        assert store.lookup(keys[:4])[1] == ["hbm", None, "nvme", "dram"]
        store.put([keys[4]], data[4:5])  # fills the free NVMe slot: nothing leaves
        assert store.lookup(keys)[1] == ["dram", None, "nvme", "nvme", "hbm"]
        assert torch.equal(store.get([keys[0], *keys[2:]]), data[[0, 2, 3, 4]])
        store.check_invariants()
