"""Where victims go when the tier below cannot take them, and what a prefix read recomputes.

The exclusive hierarchy sends a victim down ("HBM victim -> DRAM -> NVMe -> dropped"): it
leaves only when no tier below can take it, and a promotion whose victims find the tier
below full of the run being promoted is declined (the run is read in place) instead of
pushing them out. A block after the first miss of a prefix read is recomputed: it is stored
afresh in the top tier and never loaded from below. Both hold for the Python manager and the
compiled chain, which must keep giving identical counts.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from store_helpers import LAYOUT, blocks, key, tiers
from tiercache.config import TierConfig, layout_preset
from tiercache.core.manager import TierManager
from tiercache.core.plans import Ev
from tiercache.core.stats import HierarchyStats
from tiercache.live.store import TieredKVStore
from tiercache.policies import EVICTION, make_admission, make_eviction
from tiercache.results import Semantics
from tiercache.sim import replay as replay_module
from tiercache.sim.array_manager import HAVE_NUMBA
from tiercache.sim.hardware import PRESETS
from tiercache.sim.loader import load_trace
from tiercache.sim.replay import ReplayData, RunSpec, replay, use_kernels
from tiercache.sim.steptrace import write_steps
from tiercache.sim.synth import ScanSpec, scan_trace
from tiercache.sim.traces import Request, write_requests

NAMES = ("hbm", "dram", "nvme")


def manager(caps, policy="lru") -> TierManager:
    names = list(zip(NAMES, caps))
    return TierManager(names, [make_eviction(policy, c) for _, c in names], [make_admission("always") for _ in names])


def contents(m: TierManager) -> list[list[int]]:
    return [sorted(d.slot_of) for d in m.dirs]


def requests_file(tmp_path, runs, name="trace.jsonl") -> str:
    path = str(tmp_path / name)
    write_requests(path, [Request(t, 512 * len(ids), 1, tuple(ids)) for t, ids in enumerate(runs)])
    return path


def tier_configs(caps) -> tuple[TierConfig, ...]:
    return tuple(TierConfig(name, cap) for name, cap in zip(NAMES, caps))


def both_paths(spec: RunSpec, data: ReplayData, monkeypatch) -> list:
    """The run's record as ``replay`` runs it (the kernels when they apply) and on the Python manager."""
    records = [replay(spec, data)]
    if use_kernels(spec):
        with monkeypatch.context() as patched:
            patched.setattr(replay_module, "use_kernels", lambda spec: False)
            records.append(replay(spec, data))
    return records


def comparable(record) -> dict:
    doc = dataclasses.asdict(record)
    doc.pop("wall_seconds")
    doc["modeled_seconds"] = {k: round(v, 6) for k, v in doc["modeled_seconds"].items()}
    for tier in doc["tiers"]:
        for name in ("in_place_seconds", "promoted_seconds"):
            tier[name] = None if tier[name] is None else round(tier[name], 6)
    doc["ttft_saved_s"] = None if doc.get("ttft_saved_s") is None else round(doc["ttft_saved_s"], 6)
    return doc


# -- victims below a full tier ---------------------------------------------------------------
def test_promotion_whose_run_fills_the_tier_below_is_read_in_place_not_dropped():
    m = manager([4, 2, 20])
    m.access([1, 2])
    m.access([3, 4, 5, 6])
    assert contents(m) == [[3, 4, 5, 6], [1, 2], []]
    m.events.drain()
    m.access([1, 2])  # the HBM victims would need DRAM, which holds only 1 and 2: declined
    events = m.events.drain()
    assert contents(m) == [[3, 4, 5, 6], [1, 2], []]
    assert (Ev.PROMOTE_SKIPPED, 1, 2, 0) in events and (Ev.HIT, 1, 2, 0) in events
    assert not any(kind in (Ev.EVICT, Ev.PROMOTE) for kind, *_ in events)
    m.check_invariants()
    with m.passing_full_tiers():  # a caller that needs the run in HBM (get_slots, a live prefetch)
        m.access([1, 2])
    assert contents(m) == [[1, 2, 5, 6], [], [3, 4]]  # the victims passed DRAM, nothing left
    assert not m._pass_full
    m.check_invariants()


def test_victims_of_a_new_block_pass_a_tier_full_of_referenced_blocks():
    m = manager([2, 2, 10])
    m.access([1, 2, 3, 4])
    assert contents(m) == [[3, 4], [1, 2], []]
    m.ref([1, 2])  # readers hold everything DRAM has
    m.events.drain()
    m.access([5])  # HBM's victim 3 cannot go to DRAM: it goes on to NVMe, never out
    assert contents(m) == [[4, 5], [1, 2], [3]]
    assert (Ev.DEMOTE, 0, 1, 2) in m.events.drain()
    m.unref([1, 2])
    m.check_invariants()


def test_victims_leave_only_when_no_tier_below_can_take_them():
    m = manager([2, 2, 2])
    m.access([1, 2, 3, 4, 5, 6])
    m.ref([1, 2, 3, 4])  # DRAM and NVMe hold nothing but referenced blocks
    m.access([7])
    assert contents(m) == [[6, 7], [3, 4], [1, 2]]  # 5 had nowhere to go
    m.unref([1, 2, 3, 4])
    m.check_invariants()


@pytest.mark.parametrize("runs, caps, misses", [
    ([[1, 2], [3, 4, 5, 6], [1, 2], [3, 4]], (4, 2, 20), 6),
    ([[1], [2], [3], [1], [2], [3]], (1, 1, 1), 3),
])
def test_request_traces_that_fit_the_hierarchy_have_only_compulsory_misses(tmp_path, monkeypatch, runs, caps, misses):
    data = ReplayData.prepare(load_trace(requests_file(tmp_path, runs)), None, None)
    for record in both_paths(RunSpec("lru", Semantics.OBJECT, tier_configs(caps)), data, monkeypatch):
        assert record.misses == misses
        assert sum(t.evictions for t in record.tiers) == 0


def test_scan_step_trace_on_three_tiers_has_no_misses(tmp_path):
    path = str(tmp_path / "scan.jsonl")
    write_steps(path, scan_trace(ScanSpec(steps=6, prompt_blocks=8, block_tokens=16)), block_tokens=16)
    data = ReplayData.prepare(load_trace(path), None, None)
    record = replay(RunSpec("lru", Semantics.DECODE, tier_configs((4, 4, 64))), data)
    assert (record.hits, record.misses) == (48, 0)
    assert sum(t.evictions for t in record.tiers) == 0


def test_store_get_never_loses_unrelated_blocks_while_nvme_has_room(tmp_path):
    data = blocks(10, 3)
    with TieredKVStore(LAYOUT, tiers(hbm=2, dram=3, nvme=100), eviction="lru", path=tmp_path / "nvme") as store:
        store.put([key(i) for i in range(10)], data)
        assert store.lookup([key(i) for i in range(10)])[1] == ["nvme"] * 5 + ["dram"] * 3 + ["hbm"] * 2
        store.get([key(i) for i in (5, 6, 7, 0, 1)])  # HBM's victims 8, 9 find DRAM all read
        assert None not in store.lookup([key(i) for i in range(10)])[1]
        assert store.stats()["tiers"][0]["evictions"] == 0
        for i in range(10):
            assert torch.equal(store.get([key(i)])[0], data[i]), i


def test_random_store_workload_keeps_every_block_while_the_hierarchy_has_room(tmp_path):
    rng = random.Random(4)
    data = blocks(24, 5)
    with TieredKVStore(LAYOUT, tiers(hbm=2, dram=3, nvme=40), eviction="lru", path=tmp_path / "nvme") as store:
        stored = []
        for step in range(40):
            if len(stored) < 24 and (not stored or rng.random() < 0.4):
                store.put([key(len(stored))], data[len(stored) : len(stored) + 1])
                stored.append(len(stored))
            else:
                wanted = rng.sample(stored, min(len(stored), rng.randint(1, 6)))
                got = store.get([key(i) for i in wanted])
                assert all(torch.equal(got[p], data[i]) for p, i in enumerate(wanted)), step
            assert None not in store.lookup([key(i) for i in stored])[1], step


# -- against a plain model, and kernels against the manager ------------------------------------
def random_requests(rng: random.Random, distinct: int, longest: int, n: int) -> list[list[int]]:
    """Requests of 1..longest ids out of ``distinct``, some repeating a run or an id."""
    out: list[list[int]] = []
    for _ in range(n):
        if out and rng.random() < 0.3:
            ids = list(rng.choice(out))
        else:
            start = rng.randrange(distinct)
            ids = [(start + k) % distinct for k in range(rng.randint(1, longest))]
        if rng.random() < 0.1:
            ids.append(ids[0])
        out.append(ids)
    return out


@pytest.mark.parametrize("policy", sorted(EVICTION))
def test_hierarchy_with_room_for_every_block_misses_each_block_once(tmp_path, monkeypatch, policy):
    """Any exclusive cascade holding every block misses each block once. The room of a
    promotion is made before its run leaves its tier, so the hierarchy is given room for the
    longest request on top of every block; lower tiers are at least as large as HBM."""
    rng = random.Random(policy)
    for case in range(6):
        top = rng.randint(1, 5)
        caps = (top, rng.randint(top, top + 4), rng.randint(top, top + 6))
        longest = rng.randint(1, top + 2)
        distinct = max(1, sum(caps) - longest - rng.randint(0, 3))
        runs = random_requests(rng, distinct, longest, 60)
        data = ReplayData.prepare(load_trace(requests_file(tmp_path, runs, f"t{case}.jsonl")), None, None)
        spec = RunSpec(policy, Semantics.OBJECT, tier_configs(caps))
        records = both_paths(spec, data, monkeypatch)
        compulsory = len({b for ids in runs for b in ids})
        for record in records:
            assert record.misses == compulsory, (policy, caps, case)
        assert all(comparable(r) == comparable(records[0]) for r in records), (policy, caps, case)


@pytest.mark.skipif(not HAVE_NUMBA, reason="the kernels need numba")
@pytest.mark.parametrize("policy", sorted(EVICTION))
@pytest.mark.parametrize("semantics", [Semantics.OBJECT, Semantics.PREFIX])
def test_kernels_equal_the_manager_on_tight_hierarchies(tmp_path, monkeypatch, policy, semantics):
    """Lower tiers smaller than HBM, or full of the promoted run: every way down is taken."""
    rng = random.Random(f"{policy}{semantics}")
    layout, hardware = layout_preset("llama-3-8b", 512), PRESETS["h200-pcie5-nvme4"]
    for case, caps in enumerate([(4, 2, 20), (3, 1, 2), (2, 2, 2), (5, 3, 9)]):
        runs = random_requests(rng, rng.randint(6, 30), 6, 80)
        data = ReplayData.prepare(load_trace(requests_file(tmp_path, runs, f"t{case}.jsonl")), layout, hardware)
        spec = RunSpec(policy, semantics, tier_configs(caps))
        assert use_kernels(spec)
        kernel, python = both_paths(spec, data, monkeypatch)
        assert comparable(kernel) == comparable(python), (policy, semantics, caps)


# -- prefix reads recompute, they do not load --------------------------------------------------
def test_recomputed_block_below_moves_to_the_top_tier_without_a_transfer():
    m = manager([2, 4])
    m.access([1, 2, 3, 4])
    assert contents(m) == [[3, 4], [1, 2]]
    m.events.drain()
    m.access([2], count_hits=False)
    events = m.events.drain()
    stats = HierarchyStats.for_tiers(zip(NAMES, (2, 4)))
    stats.consume(events)
    assert contents(m) == [[2, 4], [1, 3]]
    assert (stats.misses, stats.recomputed, stats.hits) == (1, 1, 0)
    assert not any(kind in (Ev.PROMOTE, Ev.INSERT, Ev.EVICT) for kind, *_ in events)  # it never left
    assert stats.blocks_moved() == {(0, 1): 1}  # 3 made room; nothing came up from DRAM
    m.check_invariants()


def test_recomputed_block_stays_below_when_the_top_has_no_room_for_it():
    m = manager([2, 2, 4])
    m.access([1, 2, 3, 4])
    m.access([1, 2], count_hits=False)  # HBM's victims would need DRAM, which holds 1 and 2
    assert contents(m) == [[3, 4], [1, 2], []]
    m.check_invariants()


def test_a_reader_without_bytes_keeps_the_copy_it_recomputes():
    m = manager([2, 4])
    m.access([1, 2, 3, 4])
    m.access([2], count_hits=False, store_misses=False)
    assert contents(m) == [[3, 4], [1, 2]]
    m.check_invariants()


def test_prefix_replay_charges_no_load_for_recomputed_blocks(tmp_path, monkeypatch):
    path = requests_file(tmp_path, [[1, 2, 3, 4], [10, 11, 12, 13], [20, 2, 3, 4]])
    data = ReplayData.prepare(load_trace(path), layout_preset("llama-3-8b", 512), PRESETS["h200-pcie5-nvme4"])
    for record in both_paths(RunSpec("lru", Semantics.PREFIX, tier_configs((4, 8))), data, monkeypatch):
        assert (record.hits, record.recomputed, record.prefill_tokens_saved) == (0, 3, 0)
        assert record.ttft_saved_s == 0.0
        assert "dram->hbm" not in record.bytes_moved
        assert record.tiers[1].promotions == 0


def test_fleet_recomputed_block_is_not_brought_from_the_shared_tier(tmp_path):
    from tiercache.sim.fleet import FleetSpec, replay_fleet
    from tiercache.sim.hardware import with_network

    path = requests_file(tmp_path, [[1, 2, 3], [50], [8, 1], [51]])
    profile = with_network(PRESETS["h200-pcie5-nvme4"], "rdma-200g")
    spec = FleetSpec(2, (TierConfig("hbm", 2),), 10)
    record = replay_fleet(spec, load_trace(path), layout_preset("llama-3-8b", 512), profile=profile)
    first = record.instances[0]
    assert first.hits == 0 and first.ttft_saved_s == 0.0
    assert not any(link.startswith("remote->") for link in first.bytes_moved)
    assert np.isclose(first.bytes_moved["hbm->remote"], 4 * layout_preset("llama-3-8b", 512).block_bytes)
