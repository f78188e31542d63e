"""The prefix-cache policies (session, cost, tinylfu): exact scenarios and the Belady bound.

The contract tests (``test_policy_contract.py``) cover them through the registry; here each
one's own rule is checked on hand-built sequences, and every eviction policy is checked to
miss at least as often as Belady (single tier, object semantics, where MIN is the optimum).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from policy_driver import load_jsonl, miss_ratio

from tiercache.config import TierConfig
from tiercache.policies import EVICTION, Hints, make_admission, make_eviction
from tiercache.policies.admission_tinylfu import TinyLFUAdmit
from tiercache.policies.cost_aware import CostAware
from tiercache.policies.session import Session
from tiercache.results import Semantics
from tiercache.sim.loader import load_trace
from tiercache.sim.replay import ReplayData, RunSpec, replay
from tiercache.sim.sweep import run_sweep

DATA = Path(__file__).parent / "data"


def _chain(policy, ids: list[int]) -> None:
    """Inserts ``ids`` as one request path (each id the parent of the next)."""
    policy.on_insert(ids, Hints(parents=[None, *ids[:-1]]))


@pytest.mark.parametrize("name", sorted(set(EVICTION) - {"belady"}))
@pytest.mark.parametrize("capacity", [50, 400])
def test_no_online_policy_beats_belady_in_object_semantics(name: str, capacity: int) -> None:
    trace = load_jsonl(DATA / "mooncake_head.jsonl")
    bound = miss_ratio(make_eviction("belady", capacity), trace)
    assert miss_ratio(make_eviction(name, capacity), trace) >= bound - 1e-12


def test_session_keeps_a_reused_path_over_newer_one_offs() -> None:
    policy = Session(4)
    _chain(policy, [1, 2])
    policy.on_access([1, 2], Hints(parents=[None, 1]))  # reused: 1 and 2 are hot
    _chain(policy, [10, 11])  # a newer one-off request
    assert policy.victims(2) == [11, 10]  # the cold request goes, tail first
    assert Session(4, hot_bonus=0.0).name == "session"


def test_session_evicts_leaves_before_their_parents() -> None:
    policy = Session(8, hot_bonus=0.0)
    _chain(policy, [1, 2, 3])
    policy.on_access([1], Hints(parents=[None]))  # the root is the most recent, but inner
    assert policy.victims(3) == [3, 2, 1]


def test_session_remembers_use_counts_of_evicted_blocks() -> None:
    policy = Session(2, ghost=1.0)
    _chain(policy, [1])
    policy.on_remove([1])
    _chain(policy, [1])  # recomputed: second use, hot at once
    _chain(policy, [2])
    assert policy.victims(1) == [2]
    no_ghost = Session(2, ghost=0.0)
    _chain(no_ghost, [1])
    no_ghost.on_remove([1])
    _chain(no_ghost, [1])
    _chain(no_ghost, [2])
    assert no_ghost.victims(1) == [1]
    policy.check_invariants()
    no_ghost.check_invariants()


def test_session_frequency_scale_keeps_the_most_used_block() -> None:
    def run(policy: Session) -> list[int]:
        _chain(policy, [1])
        policy.on_access([1], Hints(parents=[None]))
        policy.on_access([1], Hints(parents=[None]))
        policy.on_access([1], Hints(parents=[None]))  # 4 uses, last at tick 4
        _chain(policy, [2])
        policy.on_access([2], Hints(parents=[None]))  # 2 uses, last at tick 6
        _chain(policy, [3])  # 1 use, tick 7
        policy.check_invariants()
        return policy.victims(3)

    # keys with freq_scale 1 (x capacity 4 ticks per doubling): 1 -> 4 + 8, 2 -> 6 + 4, 3 -> 7
    assert run(Session(4, hot_bonus=0.0, experts=(), freq_scale=1.0)) == [3, 2, 1]
    assert run(Session(4, hot_bonus=0.0, experts=())) == [1, 2, 3]  # recency alone
    with pytest.raises(ValueError, match="freq_scale"):
        Session(4, experts=((0.0, -1.0),))
    with pytest.raises(ValueError, match="pair"):
        Session(4, experts=((0.0, 1.0, 2.0),))
    assert Session(4, experts=[[0.0, 2.0]])._orderings == ((2.0, 0.0), (0.0, 2.0))


def test_session_default_experts_include_a_frequency_ordering() -> None:
    policy = Session(8)
    assert [s.policy._scale for s in policy._shadows] == [0.0, 0.0, 0.0, 16.0, 16.0]
    assert [s.policy._bonus for s in policy._shadows] == [16.0, 0.0, 64.0, 0.0, 32.0]


def test_cost_keeps_deeper_blocks_at_equal_use() -> None:
    policy = CostAware(8, depth_scale=1.0)
    _chain(policy, [1, 2, 3])  # depths 0, 1, 2: costs 1, 2, 3
    _chain(policy, [7])  # a root: cost 1, inserted last
    assert policy.victims(1) == [7]  # among leaves 3 (cost 3) and 7 (cost 1)
    assert [policy.recompute_cost(d) for d in range(3)] == [1.0, 2.0, 3.0]


def test_cost_ages_by_inflation() -> None:
    policy = CostAware(2, depth_scale=1e9)  # every block costs ~1
    _chain(policy, [1])
    policy.on_access([1, 1, 1], Hints(parents=[None] * 3))  # key 4
    _chain(policy, [2])  # key 1
    policy.on_remove([2])  # inflation 1
    victims = []
    for fresh in (3, 4, 5):  # key = inflation + 1 each: 2, 3, 4 while the inflation climbs
        _chain(policy, [fresh])
        victims.extend(policy.victims(1))
        policy.on_remove(victims[-1:])
    assert victims == [3, 4, 1]  # at equal keys (4) the older entry goes: 1 has aged out


def test_tinylfu_admits_from_the_threshold_on() -> None:
    policy = make_admission("tinylfu")
    assert policy.admit([5, 6, 5]) == [False, False, True]
    assert policy.admit([6]) == [True]
    strict = TinyLFUAdmit(width=64, threshold=3)
    assert strict.admit([1, 1, 1]) == [False, False, True]


def test_tinylfu_estimates_never_undercount_and_halve() -> None:
    policy = TinyLFUAdmit(width=16)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 1000, size=150).tolist()  # 150 < 10 x 16: no reset yet
    policy.admit(ids)
    for block_id in set(ids):
        assert policy.estimate(block_id) >= ids.count(block_id)
    policy.admit(list(range(10)))  # 160 sightings: every counter halves
    policy.check_invariants()
    assert policy._added == 0


@pytest.mark.parametrize("policy", ["session", "cost"])
def test_prefix_policies_run_a_three_tier_hierarchy_with_tinylfu(policy: str) -> None:
    doc = run_sweep(str(DATA / "kvtester_sample"), [policy, "lru"], [], ["prefix"], tiers="hbm=200,dram=400,nvme=800")
    runs = {r["policy"]: r for r in doc["runs"]}
    assert runs[policy]["accesses"] == runs["lru"]["accesses"]
    assert sum(t["hits"] for t in runs[policy]["tiers"]) == runs[policy]["hits"]
    spec = RunSpec(policy, Semantics.PREFIX, (TierConfig("hbm", 200), TierConfig("dram", 400)), admission="tinylfu")
    record = replay(spec, ReplayData.prepare(load_trace(DATA / "kvtester_sample"), None, None))
    assert record.tiers[1].refused > 0  # first demotions of a block are refused by the sketch


def test_generator_is_seeded(tmp_path) -> None:
    script = Path(__file__).parent.parent / "scripts" / "gen_kvtester.py"
    for out in ("a", "b"):
        subprocess.run([sys.executable, str(script), "--out", str(tmp_path / out), "--conversations", "12", "--seed", "5"],
                       check=True, capture_output=True)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert len(names) == 12
    assert all((tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes() for n in names)


class PlainSession(Session):
    """``session`` without experts (one fixed head start), for the shadow check below."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, experts=())


def test_a_shadow_counts_the_misses_the_manager_counts() -> None:
    from tiercache.policies.session import _Shadow

    trace = load_trace(DATA / "kvtester_sample")
    spec = RunSpec("test_prefix_policies:PlainSession", Semantics.PREFIX, (TierConfig("hbm", 300),))
    record = replay(spec, ReplayData.prepare(trace, None, None))
    shadow = _Shadow(300, 2.0, 8.0)
    ids = trace.ids.tolist()
    for a, b in zip(trace.offsets[:-1].tolist(), trace.offsets[1:].tolist()):
        for k in range(a, b):
            shadow.step(ids[k], ids[k - 1] if k > a else None, k, 1.0)
    assert shadow.misses == record.misses


def test_session_follows_the_leading_shadow() -> None:
    policy = Session(6, experts=(0.0,))
    rng = np.random.default_rng(4)
    for _ in range(40):  # requests over a small forest: roots 0..3, children 10*root + k
        root = int(rng.integers(0, 4))
        path = [root, *(10 * (root + 1) + k for k in range(int(rng.integers(0, 4))))]
        parents = [None, *path[:-1]]
        known = [b in policy for b in path]
        for block_id, parent, tracked in zip(path, parents, known):
            if tracked:
                policy.on_access([block_id], Hints(parents=[parent]))
            else:
                if len(policy) >= policy.capacity:
                    policy.on_remove(policy.victims(1))
                policy.on_insert([block_id], Hints(parents=[parent]))
        policy.check_invariants()
    policy._pick_leader(policy._clock)
    scores = [s.score(policy._clock, policy._decay) for s in policy._shadows]
    assert len(policy._shadows) == 2 and scores[policy._leader] == min(scores)
    assert policy._bonus == (2.0, 0.0)[policy._leader] * 6
    leader = policy._shadows[policy._leader].policy
    victim = policy.victims(1)[0]
    leaves = [b for b in range(60) if b in policy and b not in policy._children]
    if any(b not in leader for b in leaves):
        assert victim not in leader  # a leaf the leader dropped goes first


def test_session_rekeys_every_block_when_the_leader_changes() -> None:
    """A head start given under one leader does not outlive it: after a change, every key is
    the new ordering's (check_invariants), and a block made hot under the old leader is no
    longer ranked above a newer cold one when the new ordering gives no head start."""
    policy = Session(4, hot_bonus=8.0, experts=(0.0,))
    hints = Hints(parents=[None])
    policy.on_insert([1], hints)
    policy.on_access([1], hints)  # hot under head start 8 capacities: key = tick + 32
    policy.on_insert([2], hints)
    assert policy.victims(1) == [2]
    policy._shadows[0].misses, policy._shadows[1].misses = 10.0, 0.0  # the no-head-start shadow leads
    policy._pick_leader(policy._clock)
    assert policy._leader == 1 and policy._bonus == 0.0
    policy.check_invariants()
    assert policy.victims(1) == [1]  # now plain recency: 1 was used before 2
    policy._shadows[1].misses = 20.0  # back to the default ordering: the head start returns
    policy._pick_leader(policy._clock)
    policy.check_invariants()
    assert policy._leader == 0 and policy.victims(1) == [2]


def test_session_runs_its_experts_in_the_top_tier_only() -> None:
    """Below the top tier a policy sees demotions, not requests: ``session`` drops its shadows
    there (``for_tier``); every other built-in policy is the same at every tier."""
    assert len(make_eviction("session", 100)._shadows) == 5
    assert len(make_eviction("session", 100, tier=0)._shadows) == 5
    lower = make_eviction("session", 100, tier=2)
    assert lower._shadows == [] and (lower._bonus, lower._scale) == (0.0, 1.0 * 100)
    for name in EVICTION:
        if name != "session":
            assert type(make_eviction(name, 50, tier=1)) is type(make_eviction(name, 50))
    spec = RunSpec("session", Semantics.PREFIX, (TierConfig("hbm", 4), TierConfig("dram", 8)))
    from tiercache.sim.replay import build_manager

    data = ReplayData.prepare(load_trace(Path(__file__).parent / "data" / "mooncake_head.jsonl"), None, None)
    manager, _ = build_manager(spec, data)
    assert [len(p._shadows) for p in manager.policies] == [5, 0]
