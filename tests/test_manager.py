"""Exact-id scenarios and reference-model checks of the tier manager (metadata plane)."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from conftest import sample_requests
from tiercache.core.directory import CountError
from tiercache.core.engine import ImmediateEngine
from tiercache.core.manager import TierManager
from tiercache.core.plans import JobResult
from tiercache.core.stats import HierarchyStats
from tiercache.policies import make_admission, make_eviction


def manager(caps, policy="lru", admission="always", write_through=False, engine=None):
    tiers = list(zip(("hbm", "dram", "nvme"), caps))
    return TierManager(
        tiers,
        [make_eviction(policy, c) for _, c in tiers],
        [make_admission("always")] + [make_admission(admission) for _ in tiers[1:]],
        engine=engine,
        write_through=write_through,
    )


def contents(m: TierManager) -> list[list[int]]:
    return [sorted(d.slot_of) for d in m.dirs]


def test_exclusive_demotion_chain_and_promotion():
    m = manager([2, 2, 2])
    m.access([1, 2, 3, 4, 5, 6])
    assert contents(m) == [[5, 6], [3, 4], [1, 2]]
    # NVMe hit: room is made in the top before 1 leaves nvme: 5 -> dram, 3 -> nvme, and
    # nvme (still full, 1 protected) drops 2; 1 then leaves a hole in nvme.
    m.access([1])
    assert contents(m) == [[1, 6], [4, 5], [3]]
    m.access([7])  # miss: 6 -> dram, 4 -> nvme fills the hole, nothing dropped
    assert contents(m) == [[1, 7], [5, 6], [3, 4]]
    m.check_invariants()


def test_hits_and_misses_are_counted_per_tier():
    m = manager([2, 2])
    stats = HierarchyStats.for_tiers([("hbm", 2), ("dram", 2)])
    m.access([1, 2, 3, 1, 3, 9])
    stats.consume(m.events.drain())
    assert [t.hits for t in stats.tiers] == [1, 1]  # 1 from dram, 3 from hbm
    assert stats.misses == 4 and stats.accesses == 6


def test_write_through_copies_down_and_keeps_lower_copy_on_eviction():
    m = manager([1, 3], write_through=True)
    m.access([1, 2])
    assert contents(m) == [[2], [1, 2]]
    m.access([1])  # dram hit: copied up, lower copy kept
    assert contents(m) == [[1], [1, 2]]
    m.check_invariants()


def test_admission_refusal_drops_the_victim():
    m = manager([1, 4], admission="second_hit") if "second_hit" in _admissions() else None
    if m is None:
        pytest.skip("second_hit admission not registered")
    m.access([1, 2])  # 1 demoted on its first sighting by dram: refused, dropped
    assert contents(m) == [[2], []]


def _admissions():
    from tiercache.policies import ADMISSION

    return ADMISSION


def test_referenced_and_pinned_blocks_are_never_victims():
    m = manager([2])
    m.access([1, 2])
    m.ref([1])
    m.access([3])  # 1 is the LRU block but referenced: 2 goes
    assert contents(m) == [[1, 3]]
    m.unref([1])
    with pytest.raises(CountError):
        m.unref([1])
    m.check_invariants()


def test_everything_protected_refuses_insert_without_state_change():
    m = manager([1])
    m.access([1])
    m.ref([1])
    m.access([2])
    assert contents(m) == [[1]]
    m.check_invariants()


def test_prepare_move_returns_none_without_state_change():
    m = manager([2, 2])
    m.access([1, 2, 3])  # hbm {2,3}, dram {1}
    before = (contents(m), dict(m.dirs[0].pins), m.dirs[1].n_free)
    assert m.prepare_move([9], 0, 1) is None  # absent
    assert m.prepare_move([2, 2], 0, 1) is None  # repeated
    assert m.prepare_move([2, 3], 0, 1) is None  # only one free dram slot
    assert (contents(m), dict(m.dirs[0].pins), m.dirs[1].n_free) == before


def test_two_phase_move_publishes_only_on_completion():
    engine = ImmediateEngine()
    m = manager([2, 2], engine=engine)
    m.access([1, 2])
    plan = m.prepare_move([1], 0, 1)
    assert plan is not None and m.locate(1) == 0 and m.dirs[0].pins == {1: 1}
    assert m.prepare_move([1], 0, 1) is None  # in flight: not moved twice
    m.check_invariants()
    engine.submit(plan)
    m.poll()
    assert m.locate(1) == 1 and m.dirs[0].pins == {}
    m.check_invariants()


def test_failed_transfer_leaves_block_where_it_was():
    engine = ImmediateEngine()
    m = manager([2, 2], engine=engine)
    m.access([1, 2])
    plan = m.prepare_move([1], 0, 1)
    m.complete(JobResult(plan.job_id, "disk on fire"))
    assert m.locate(1) == 0 and m.dirs[1].n_free == 2
    m.check_invariants()


def test_failed_demotion_keeps_the_victim_and_refuses_the_newcomer():
    engine = ImmediateEngine()
    m = manager([1, 1], engine=engine)
    m.access([1])
    engine.fail_next = 1
    m.access([2])  # demotion of 1 fails: 1 stays, 2 is refused; never dropped for a failed write
    assert contents(m) == [[1], []]
    m.check_invariants()


def test_repeated_id_inside_a_batch_is_a_hit_the_second_time():
    m = manager([4])
    stats = HierarchyStats.for_tiers([("hbm", 4)])
    m.access([5, 6, 5])
    stats.consume(m.events.drain())
    assert (stats.hits, stats.misses) == (1, 2)


def _reference_hierarchy(requests, caps, refresh_top_on_hit):
    """Plain-Python exclusive hierarchy, one access at a time (the semantics of the manager)."""
    tiers = [OrderedDict() for _ in caps]
    hits, misses = [0] * len(caps), 0

    def room(t, protected):
        if len(tiers[t]) < caps[t]:
            return True
        victim = next((v for v in tiers[t] if v not in protected), None)
        if victim is None:
            return False
        del tiers[t][victim]
        if t + 1 < len(tiers) and room(t + 1, protected):
            tiers[t + 1][victim] = None
        return True

    for request in requests:
        for x in request:
            where = next((i for i, tier in enumerate(tiers) if x in tier), None)
            if where == 0:
                hits[0] += 1
                if refresh_top_on_hit:
                    tiers[0].move_to_end(x)
            elif where is None:
                misses += 1
                room(0, set())
                tiers[0][x] = None
            else:
                hits[where] += 1
                if room(0, {x}):
                    del tiers[where][x]
                    tiers[0][x] = None
    return hits, misses


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_hierarchy_matches_plain_reference_on_sample_trace(policy):
    requests = sample_requests()[:1500]
    caps = [300, 900, 2500]
    m = manager(caps, policy)
    stats = HierarchyStats.for_tiers(zip(("hbm", "dram", "nvme"), caps))
    for request in requests:
        for x in request:
            m.access([x])
        stats.consume(m.events.drain())
    m.check_invariants()
    assert ([t.hits for t in stats.tiers], stats.misses) == _reference_hierarchy(requests, caps, policy == "lru")


def test_single_tier_batches_equal_one_at_a_time():
    requests = sample_requests()[:800]
    results = []
    for batched in (True, False):
        m = manager([700])
        stats = HierarchyStats.for_tiers([("hbm", 700)])
        for request in requests:
            if batched:
                m.access(request)
            else:
                for x in request:
                    m.access([x])
            stats.consume(m.events.drain())
        results.append((stats.hits, stats.misses))
    assert results[0] == results[1]
