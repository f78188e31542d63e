"""Probe L findings on the tier manager: pinned slots and long prefetches.

F4: a batched insert (a store's ``put``, an ``access`` miss) was cut into chunks the size of the
smallest tier and a chunk larger than the unpinned slots of the top tier was refused whole,
though one-at-a-time inserts stored every block. Now a chunk is cut to what room can be made
for, and only blocks no room can be made for are refused (counted exactly).

F5: a prefetch asked room for its whole per-tier run at once, so a run longer than HBM (or than
a tier on its victims' way down) moved nothing, uncounted. Now it moves in pieces, first ids
first, and what finds no room is counted as ``promote_skipped`` in its tier.
"""

from __future__ import annotations

import torch

from tiercache import TieredKVStore
from tiercache.config import KVLayout, TierConfig
from tiercache.core.manager import TierManager
from tiercache.core.stats import HierarchyStats
from tiercache.policies import make_admission, make_eviction

_NAMES = ("hbm", "dram", "nvme")


def _manager(caps, policy="lru", write_through=False) -> TierManager:
    tiers = list(zip(_NAMES, caps))
    return TierManager(tiers, [make_eviction(policy, c) for _, c in tiers], [make_admission("always") for _ in tiers],
                       write_through=write_through)


def _counters(m: TierManager) -> HierarchyStats:
    stats = HierarchyStats.for_tiers([(d.name, d.capacity) for d in m.dirs])
    stats.consume(m.events.drain())
    return stats


def _resident(m: TierManager, ids) -> list[int]:
    return [b for b in ids if m.locate(b) is not None]


# ----------------------------------------------------------------------------- F4: inserts


def test_a_batched_insert_goes_through_the_one_unpinned_top_slot():
    m = _manager([2, 2, 8])
    m.insert([100])
    m.ref([100])  # one of the two HBM slots pinned by a reader: 11 slots free in the hierarchy
    m.events.drain()
    m.insert(list(range(6)))
    stats = _counters(m)
    assert _resident(m, range(6)) == list(range(6))
    assert [t.refused for t in stats.tiers] == [0, 0, 0] and stats.tiers[0].inserts == 6
    assert m.locate(100) == 0
    m.check_invariants()


def test_batched_misses_store_what_one_at_a_time_misses_store_with_pins():
    for write_through in (False, True):
        batched, single = _manager([4, 2, 8], write_through=write_through), _manager([4, 2, 8], write_through=write_through)
        for m in (batched, single):
            m.insert([100, 101, 102])
            m.ref([100, 101, 102])  # 3 of 4 HBM slots pinned
            m.events.drain()
        batched.access(list(range(6)))
        for block_id in range(6):
            single.access([block_id])
        assert [sorted(d.slot_of) for d in batched.dirs] == [sorted(d.slot_of) for d in single.dirs]
        assert [t.refused for t in _counters(batched).tiers] == [0, 0, 0]
        batched.check_invariants()


def test_only_the_blocks_no_room_can_be_made_for_are_refused_and_counted():
    m = _manager([4])
    m.insert([100])
    m.ref([100])
    m.events.drain()
    m.insert(list(range(5)), hold=True)  # 3 slots can take held blocks; the last tier never drops them
    stats = _counters(m)
    assert _resident(m, range(5)) == [0, 1, 2] and sorted(m.held) == [0, 1, 2]
    assert stats.tiers[0].refused == 2 and stats.tiers[0].inserts == 3
    m.check_invariants()


def test_an_insert_into_a_tier_pinned_whole_is_refused_whole():
    m = _manager([2, 2])
    m.insert([100, 101])
    m.ref([100, 101])
    m.events.drain()
    m.insert([1, 2, 3])
    assert _resident(m, [1, 2, 3]) == [] and _counters(m).tiers[0].refused == 3


def test_a_store_put_with_a_pinned_key_stores_the_whole_batch(tmp_path):
    layout = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
    keys = [i.to_bytes(16, "little") for i in range(7)]
    tiers = [TierConfig("hbm", 2), TierConfig("dram", 2), TierConfig("nvme", 8)]
    with TieredKVStore(layout, tiers, eviction="lru", path=tmp_path / "nvme", device="cpu") as store:
        store.put(keys[6:], torch.randn(1, *layout.block_shape).half())
        store.pin(keys[6:])
        assert store.put(keys[:6], torch.randn(6, *layout.block_shape).half()) == 6
        assert None not in store.lookup(keys[:6])[1]
        assert [t["refused"] for t in store.stats()["tiers"]] == [0, 0, 0]
        store.release(keys[6:])


# ----------------------------------------------------------------------------- F5: prefetch


def _all_on_nvme(caps, n_prefetch: int) -> tuple[TierManager, list[int]]:
    """HBM and DRAM full of other blocks, ``n_prefetch`` blocks (ids 0..) on NVMe, NVMe slots free."""
    m = _manager(caps)
    m.insert(list(range(caps[0] + caps[1] + n_prefetch + 2)))
    assert all(m.locate(b) == 2 for b in range(n_prefetch))
    m.events.drain()
    return m, list(range(n_prefetch))


def test_a_prefetch_longer_than_dram_moves_in_pieces():
    m, ids = _all_on_nvme([8, 4, 64], 5)
    plans = m.prefetch(ids)
    assert sum(p.n_blocks for p in plans) == 5
    m.wait_all()
    assert [m.locate(b) for b in ids] == [0] * 5
    assert [t.promote_skipped for t in _counters(m).tiers] == [0, 0, 0]
    m.check_invariants()


def test_a_prefetch_longer_than_hbm_moves_the_first_blocks_and_counts_the_rest():
    m, ids = _all_on_nvme([8, 8, 64], 9)
    plans = m.prefetch(ids)
    assert [b for p in plans for b in p.ids] == ids[:8]
    m.wait_all()
    assert [m.locate(b) for b in ids] == [0] * 8 + [2]
    assert [t.promote_skipped for t in _counters(m).tiers] == [0, 0, 1]
    m.check_invariants()


def test_a_prefetch_into_a_partly_pinned_top_moves_what_fits():
    m, ids = _all_on_nvme([4, 4, 16], 4)  # HBM holds 8..11
    m.ref([10, 11])  # two of the four HBM slots pinned by readers
    plans = m.prefetch(ids)
    assert [b for p in plans for b in p.ids] == [0, 1]
    m.wait_all()
    assert [m.locate(b) for b in ids] == [0, 0, 2, 2] and m.locate(10) == m.locate(11) == 0
    assert [t.promote_skipped for t in _counters(m).tiers] == [0, 0, 2]
    m.check_invariants()


def test_a_store_prefetch_longer_than_dram_moves_every_block(tmp_path):
    layout = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
    keys = [i.to_bytes(16, "little") for i in range(19)]
    tiers = [TierConfig("hbm", 8), TierConfig("dram", 4), TierConfig("nvme", 64)]
    with TieredKVStore(layout, tiers, eviction="lru", path=tmp_path / "nvme", device="cpu") as store:
        store.put(keys, torch.randn(len(keys), *layout.block_shape).half())
        pending = store.prefetch(keys[:5])
        store.wait(pending)
        assert pending.blocks == 5 and store.lookup(keys[:5])[1] == ["hbm"] * 5
