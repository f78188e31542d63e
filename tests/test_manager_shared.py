"""Exact-id scenarios of a shared last tier (the remote tier's view), metadata plane only."""

from __future__ import annotations

from tiercache.core.engine import ImmediateEngine
from tiercache.core.manager import TierManager
from tiercache.core.plans import Ev
from tiercache.policies import make_admission, make_eviction


def shared_manager(caps, engine=None, write_through=False) -> TierManager:
    """hbm, dram, ..., remote (the last tier is shared)."""
    names = ("hbm", "dram", "nvme")[: len(caps) - 1] + ("remote",)
    tiers = list(zip(names, caps))
    return TierManager(tiers, [make_eviction("lru", c) for _, c in tiers],
                       [make_admission("always") for _ in tiers], engine=engine, write_through=write_through, shared_last=True)


def contents(m: TierManager) -> list[list[int]]:
    return [sorted(d.slot_of) for d in m.dirs]


def test_publish_copies_into_the_shared_tier_and_keeps_the_local_block():
    m = shared_manager([2, 2, 8])
    m.access([1, 2, 3])  # 1 demoted to dram
    plans = m.publish([1, 2, 3, 3, 99])  # 99 is absent, 3 repeated: skipped
    assert sorted(p.src_tier for p in plans) == [0, 1] and all(p.keep_source for p in plans)
    m.wait_all()
    assert contents(m) == [[2, 3], [1], [1, 2, 3]]
    assert m.publish([1, 2]) == []  # already shared
    m.check_invariants()  # exclusivity holds over the local tiers only


def test_victim_already_shared_leaves_without_a_copy():
    engine = ImmediateEngine()
    m = shared_manager([1, 1, 8], engine=engine)
    m.access([1])
    m.publish([1])
    m.wait_all()
    m.access([2])  # 1 -> dram (a local demotion: one copy)
    m.events.drain()
    submitted = engine.submitted
    m.access([3])  # 2 -> dram, 1 leaves dram: the shared tier already holds it
    assert contents(m) == [[3], [2], [1]]
    assert engine.submitted == submitted + 1  # only the hbm -> dram move copied bytes
    kinds = [(Ev(k), t, n, aux) for k, t, n, aux in m.events.drain()]
    assert (Ev.DEMOTE, 1, 1, 2) in kinds
    m.check_invariants()


def test_failed_write_into_the_shared_tier_drops_the_victim_instead_of_refusing():
    engine = ImmediateEngine()
    m = shared_manager([1, 1, 8], engine=engine)
    m.access([1, 2])  # 1 in dram, 2 in hbm
    engine.fail_next = 1  # the dram -> remote write of 1 will fail
    m.access([3])  # needs room in dram: 1 must go to the remote tier
    assert contents(m) == [[3], [2], []]  # 1 dropped (an eviction), 3 placed all the same
    kinds = [Ev(k) for k, *_ in m.events.drain()]
    assert Ev.TRANSFER_FAILED in kinds and Ev.EVICT in kinds and Ev.REFUSED not in kinds
    m.check_invariants()


def test_promotion_from_the_shared_tier_moves_it_into_hbm():
    m = shared_manager([2, 4])
    m.restore(1, [7, 8])  # adopted from the store by a lookup
    m.access([7, 8])
    assert contents(m) == [[7, 8], []]
    m.check_invariants()


def test_write_through_hierarchy_does_not_copy_down_into_the_shared_tier():
    m = shared_manager([2, 2, 4], write_through=True)
    m.access([1, 2])
    assert contents(m) == [[1, 2], [1, 2], []]  # publishing is the store's decision
    m.publish([1])
    m.wait_all()
    assert contents(m)[2] == [1]
    m.check_invariants()


def test_without_a_shared_tier_publish_is_a_no_op_and_copies_stay_refused():
    m = TierManager([("hbm", 2), ("dram", 2)], [make_eviction("lru", 2), make_eviction("lru", 2)],
                    [make_admission("always"), make_admission("always")])
    m.access([1, 2, 3])
    assert m.publish([1, 2, 3]) == []
    assert m.prepare_move([3], 0, 1, keep_source=True) is None
