"""Traces whose ids do not chain the prefix (content hashes of single blocks, or hand-made
files) still replay: ids repeat inside a request, back to back too, and one id follows
different ids in different requests. Every registered eviction policy runs them in prefix
semantics on one tier, three exclusive tiers, three write-through tiers and a fleet with a
shared tier, with the manager's invariants checked at the end of each replay."""

from __future__ import annotations

import random

import pytest

from tiercache.config import TierConfig
from tiercache.core.manager import TierManager
from tiercache.policies import EVICTION, make_admission, make_eviction
from tiercache.results import Route, Semantics
from tiercache.sim.fleet import FleetSpec, replay_fleet
from tiercache.sim.loader import load_trace
from tiercache.sim.replay import ReplayData, RunSpec, replay
from tiercache.sim.traces import Request, write_requests

ONLINE = sorted(p for p in EVICTION if p != "belady")


@pytest.fixture(scope="module")
def unchained(tmp_path_factory):
    rng = random.Random(5)
    requests = []
    for r in range(400):
        ids = [rng.randint(0, 60) for _ in range(rng.randint(1, 30))]
        requests.append(Request(r, 512 * len(ids), 3, tuple(ids)))
    path = tmp_path_factory.mktemp("unchained") / "t.jsonl"
    write_requests(path, requests)
    assert any(a == b for r in requests for a, b in zip(r.hash_ids, r.hash_ids[1:]))  # back-to-back repeats
    return ReplayData.prepare(load_trace(path), None, None)


@pytest.mark.parametrize("policy", sorted(EVICTION))
@pytest.mark.parametrize("shape", ["one", "exclusive", "write_through"])
def test_every_policy_replays_unchained_ids(unchained, policy, shape) -> None:
    tiers = ((TierConfig("hbm", 12),) if shape == "one"
             else (TierConfig("hbm", 5), TierConfig("dram", 10), TierConfig("nvme", 20)))
    record = replay(RunSpec(policy, Semantics.PREFIX, tiers, write_through=shape == "write_through"), unchained)
    assert record.accesses == len(unchained.ids) and record.hits > 0


def test_fleet_with_a_shared_tier_replays_unchained_ids(unchained) -> None:
    tiers = (TierConfig("hbm", 5), TierConfig("dram", 10))
    for policy in ONLINE:
        spec = FleetSpec(3, tiers, 40, Route.PREFIX_AFFINITY, policy)
        record = replay_fleet(spec, unchained.trace)
        assert record.accesses == len(unchained.ids) and record.shared_hits > 0, policy


def test_evict_names_an_id_twice() -> None:
    manager = TierManager([("hbm", 4)], [make_eviction("session", 4)], [make_admission("always")])
    manager.access([1, 2, 3])
    manager.evict([2, 2, 3])
    assert [manager.locate(b) for b in (1, 2, 3)] == [0, None, None]
    manager.check_invariants()
