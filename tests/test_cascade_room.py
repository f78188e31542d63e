"""The demotion cascade keeps every block it can: batched victims, runs that hold their own
room, moves in flight, and a prefix read's own promotions.

- the victims of one batched insert never outnumber a tier below (inserts come in chunks no
  larger than the smallest tier), so they are split over the tiers below as one-at-a-time
  inserts would split them;
- a promoted run whose victims need the slots the run itself holds moves in pieces while the
  hierarchy has a free slot, so nothing leaves; with every tier full the victims still leave;
- a block leaves the last tier only after this manager's moves in flight out of that tier
  have landed (a prefetch, which never waits, goes without instead);
- a prefix read pins its cached prefix in the hierarchy, so every block counted as reused
  was a hit.

Both the Python manager and the compiled chain, with identical counts.
"""

from __future__ import annotations

import random

import pytest
import torch

from store_helpers import LAYOUT, blocks, key, tiers
from test_hierarchy_room import both_paths, comparable, contents, manager, random_requests, requests_file, tier_configs
from tiercache.config import TierConfig, layout_preset
from tiercache.core.manager import TierManager
from tiercache.core.plans import Ev
from tiercache.live.store import TieredKVStore
from tiercache.policies import EVICTION, make_admission, make_eviction
from tiercache.results import Semantics
from tiercache.sim.hardware import PRESETS
from tiercache.sim.loader import load_trace
from tiercache.sim.replay import ReplayData, RunSpec

LLAMA, H200 = layout_preset("llama-3-8b", 512), PRESETS["h200-pcie5-nvme4"]


def lookups(store: TieredKVStore, n: int) -> list:
    return store.lookup([key(i) for i in range(n)])[1]


# -- F2: batched victims -----------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_batched_insert_splits_its_victims_over_the_tiers_below(policy):
    batched, single = manager([4, 2, 2], policy), manager([4, 2, 2], policy)
    batched.access([1, 2, 3, 4])
    batched.access([5, 6, 7, 8])  # four HBM victims, two slots in DRAM, two in NVMe
    for block_id in range(1, 9):
        single.access([block_id])
    assert contents(batched) == contents(single) == [[5, 6, 7, 8], [3, 4], [1, 2]]
    assert not any(kind == Ev.EVICT for kind, *_ in batched.events.drain())
    batched.check_invariants()


def test_replayed_batch_keeps_its_victims_whatever_the_policy_batches(tmp_path, monkeypatch):
    data = ReplayData.prepare(load_trace(requests_file(tmp_path, [[1, 2, 3, 4], [5, 6, 7, 8], [4]])), None, None)
    for policy in ("lru", "lfu"):  # lru inserts in batches, lfu one block at a time
        for record in both_paths(RunSpec(policy, Semantics.OBJECT, tier_configs((4, 2, 2))), data, monkeypatch):
            assert record.misses == 8 and record.tiers[1].hits == 1, policy  # [4] is found in DRAM
            assert [t.evictions for t in record.tiers] == [0, 0, 1], policy  # the full hierarchy's one


def test_store_put_keeps_batched_victims_while_a_lower_tier_has_room(tmp_path):
    data = blocks(8, 1)
    layout = [TierConfig("hbm", 4), TierConfig("dram", 2), TierConfig("nvme", 4)]
    with TieredKVStore(LAYOUT, layout, eviction="lru", path=tmp_path / "nvme") as store:
        store.put([key(i) for i in range(4)], data[:4])
        store.put([key(i) for i in range(4, 8)], data[4:])
        assert lookups(store, 8) == ["nvme", "nvme", "dram", "dram"] + ["hbm"] * 4
        for i in range(8):
            assert torch.equal(store.get([key(i)])[0], data[i]), i


# -- F3: a run that holds the room its victims need ----------------------------------------------
def filled(caps, n):
    m = manager(caps)
    for block_id in range(n):
        m.access([block_id])
    m.events.drain()
    return m


def test_run_off_the_last_tier_moves_in_pieces_while_the_hierarchy_has_room():
    m = filled([2, 2, 4], 7)  # NVMe 0, 1, 2 and a free slot
    m.access([0, 1])
    events = m.events.drain()
    assert contents(m) == [[0, 1], [5, 6], [2, 3, 4]]
    assert not any(kind == Ev.EVICT for kind, *_ in events)
    assert [e for e in events if e[0] == Ev.PROMOTE] == [(Ev.PROMOTE, 2, 1, 0)] * 2
    m.check_invariants()


def test_run_in_a_full_hierarchy_still_evicts():
    m = filled([2, 2, 4], 8)
    m.access([0, 1])
    stats = [e for e in m.events.drain() if e[0] == Ev.EVICT]
    assert stats == [(Ev.EVICT, 2, 2, 0)] and contents(m)[0] == [0, 1]
    m.check_invariants()


def test_store_get_of_a_run_on_nvme_loses_nothing_while_there_is_room(tmp_path):
    data = blocks(7, 2)
    with TieredKVStore(LAYOUT, tiers(hbm=2, dram=2, nvme=4), eviction="lru", path=tmp_path / "nvme") as store:
        for i in range(7):
            store.put([key(i)], data[i : i + 1])
        got = store.get([key(0), key(1)])
        assert torch.equal(got, data[:2])
        assert None not in lookups(store, 7) and store.stats()["tiers"][2]["evictions"] == 0
        for i in range(7):
            assert torch.equal(store.get([key(i)])[0], data[i]), i


# -- F4: moves in flight -----------------------------------------------------------------------
def test_store_waits_for_a_move_out_of_nvme_before_dropping_there(tmp_path):
    data = blocks(5, 3)
    c, d, b, e, a = range(5)
    with TieredKVStore(LAYOUT, tiers(hbm=2, dram=1, nvme=3), eviction="lru", path=tmp_path / "nvme") as store:
        for i in (c, d, b, e, a):
            store.put([key(i)], data[i : i + 1])
        store.prefetch([key(c)])  # C: NVMe -> HBM, left in flight
        store.access([key(d)], data[d : d + 1])  # D is stored: a hit, promoted out of NVMe (a put moves no bytes out of it)
        store.wait()
        assert None not in lookups(store, 5)
        assert [t["evictions"] for t in store.stats()["tiers"]] == [0, 0, 0]
        for i in range(5):
            assert torch.equal(store.get([key(i)])[0], data[i]), i


def test_prefetch_never_waits_for_its_own_moves():
    m = manager([3, 3, 1], "arc")
    m.access([1, 2, 3, 5, 6, 0, 4])
    m.make_room(0, 3)
    m.access([2, 3])
    for plan in m.prefetch([0, 1]):
        assert plan.job_id in m.inflight
    m.wait_all()
    m.check_invariants()


def test_a_block_a_move_in_flight_brings_to_the_top_meanwhile_is_found_there():
    m = manager([2, 2], "arc")
    m.access([8, 0, 2])
    m.access([8], wait=False)
    m.access([1, 8], count_hits=False)  # room for 1 waits for 8's move out of DRAM
    m.wait_all()
    assert 8 in m.dirs[0].slot_of
    m.check_invariants()


# -- F1: a prefix read pins its cached prefix --------------------------------------------------
def test_prefix_block_pushed_out_by_its_own_request_is_not_counted_as_reused(tmp_path, monkeypatch):
    path = requests_file(tmp_path, [[2], [1], [3], [4], [1, 4, 2]])
    data = ReplayData.prepare(load_trace(path), LLAMA, H200)
    for record in both_paths(RunSpec("lru", Semantics.PREFIX, tier_configs((2, 2))), data, monkeypatch):
        # the last request is found whole and computes its last prompt token (probe q17)
        assert record.hits == 3 and record.prefill_tokens_saved == 3 * 512 - 1


@pytest.mark.parametrize("policy", sorted(EVICTION))
def test_prefix_tokens_saved_never_exceed_the_blocks_served(tmp_path, monkeypatch, policy):
    rng = random.Random(f"saved{policy}")
    for case, caps in enumerate([(2, 2), (2, 1, 2), (3, 2, 3), (1, 2, 2), (4, 2, 5)]):
        runs = random_requests(rng, rng.randint(4, 14), 5, 60)
        data = ReplayData.prepare(load_trace(requests_file(tmp_path, runs, f"t{case}.jsonl")), LLAMA, H200)
        records = both_paths(RunSpec(policy, Semantics.PREFIX, tier_configs(caps)), data, monkeypatch)
        for record in records:
            assert record.prefill_tokens_saved <= record.hits * data.block_tokens, (policy, caps, case)
        assert all(comparable(r) == comparable(records[0]) for r in records), (policy, caps, case)


# -- moves in flight out of a middle tier ------------------------------------------------------
def prefetched_out_of_dram():
    """HBM 2 / DRAM 2 / NVMe 2 holding 5 blocks, with block 1's prefetch DRAM -> HBM in flight:
    it holds a slot at both ends, so the hierarchy has no free slot until it lands."""
    m = filled([2, 2, 2], 5)
    assert contents(m) == [[3, 4], [1, 2], [0]]
    m.prefetch([1])
    assert contents(m) == [[4], [1, 3], [0, 2]] and m._running  # HBM: 4 and a slot reserved for 1
    assert sum(d.n_free for d in m.dirs) == 0
    return m


def test_a_read_waits_for_a_move_out_of_a_middle_tier_instead_of_dropping():
    m = prefetched_out_of_dram()
    m.access([0])  # HBM's victim goes to the DRAM slot block 1's move frees, not down a full NVMe
    m.wait_all()
    assert sorted(b for tier in contents(m) for b in tier) == [0, 1, 2, 3, 4]
    assert not [e for e in m.events.drain() if e[0] == Ev.EVICT]
    m.check_invariants()


def test_a_prefetch_pushes_nothing_out_while_moves_are_in_flight():
    m = prefetched_out_of_dram()
    m.prefetch([0])  # may not wait for block 1: it goes without rather than drop block 2
    m.wait_all()
    assert sorted(b for tier in contents(m) for b in tier) == [0, 1, 2, 3, 4]
    m.check_invariants()


def write_through_filled() -> TierManager:
    """Write-through HBM 2 / DRAM 2 / NVMe 4 after blocks 0..3: NVMe holds a copy of each."""
    m = TierManager([("hbm", 2), ("dram", 2), ("nvme", 4)], [make_eviction("lru", c) for c in (2, 2, 4)],
                    [make_admission("always") for _ in range(3)], write_through=True)
    for block_id in range(4):
        m.access([block_id])
    return m


def test_a_write_through_prefetch_starts_while_another_is_in_flight():
    m = write_through_filled()
    first, second = m.prefetch([0]), m.prefetch([1])  # HBM copies may go: NVMe keeps every block
    assert first and second
    m.wait_all()
    assert {0, 1} <= set(m.dirs[0].slot_of)
    m.check_invariants()


def test_a_copy_in_flight_out_of_a_tier_is_not_waited_for_room_there():
    m = write_through_filled()
    m.prefetch([0])  # a copy out of NVMe: it frees no NVMe slot
    copy = next(iter(m._running))
    waited = []
    m.wait, plain = (lambda job_id: waited.append(job_id) or plain(job_id)), m.wait
    m.access([4])  # its copy down needs room in NVMe: an eviction there, not a wait for the copy
    assert copy not in waited
    m.wait_all()
    m.check_invariants()


def test_a_block_lost_twice_while_pinned_keeps_both_readers_counts():
    m = filled([2, 2, 2], 5)
    for _ in range(2):
        m.ref([0])
        m.report_lost(2, [0])  # its NVMe bytes proved unreadable
        m.access([0])  # stored anew
        m.check_invariants()
        while 0 not in m.dirs[2].slot_of:  # push it back down to NVMe for the second loss
            m.access([max(b for d in m.dirs for b in d.slot_of) + 1])
    assert m.orphan_refs[0] == 2
    m.unref([0])
    m.unref([0])
    assert 0 not in m.orphan_refs and 0 not in m.refs
    m.check_invariants()
