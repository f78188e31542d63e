"""Hypothesis state machine: random operations on a multi-tier manager, invariants after each."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiercache.core.directory import CountError
from tiercache.core.engine import ImmediateEngine
from tiercache.core.manager import TierManager
from tiercache.core.plans import JobResult
from tiercache.core.stats import HierarchyStats
from tiercache.policies import EVICTION, make_admission, make_eviction

IDS = st.integers(min_value=0, max_value=14)
POLICIES = sorted(p for p in EVICTION if p != "belady")


class ManagerMachine(RuleBasedStateMachine):
    """Drives insert/access/ref/unref/evict/make_room/transfer/complete, and the non-blocking
    path (prefetch, access without waiting, poll/wait_all), in random order."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[int] = []  # jobs prepared by the test, completed later in any order
        self.manager: TierManager | None = None
        self.refs: dict[int, int] = {}
        self.stats: HierarchyStats | None = None

    @rule(policy=st.sampled_from(POLICIES), caps=st.lists(st.integers(1, 6), min_size=1, max_size=3), wt=st.booleans())
    @precondition(lambda self: self.manager is None)
    def build(self, policy, caps, wt):
        names = ("hbm", "dram", "nvme")[: len(caps)]
        self.manager = TierManager(
            list(zip(names, caps)),
            [make_eviction(policy, c) for c in caps],
            [make_admission("always") for _ in caps],
            engine=ImmediateEngine(),
            write_through=wt,
        )
        self.stats = HierarchyStats.for_tiers(zip(names, caps))

    def _ready(self) -> bool:
        return self.manager is not None

    @precondition(_ready)
    @rule(ids=st.lists(IDS, min_size=1, max_size=8))
    def access(self, ids):
        self.manager.access(ids)
        total = sum(len(d) for d in self.manager.dirs)
        assert total <= sum(d.capacity for d in self.manager.dirs)

    @precondition(_ready)
    @rule(ids=st.lists(IDS, min_size=1, max_size=4, unique=True))
    def access_recompute(self, ids):
        self.manager.access(ids, count_hits=False)

    @precondition(_ready)
    @rule(ids=st.lists(IDS, min_size=1, max_size=6))
    def prefetch(self, ids):
        """Starts moves up to the top and leaves them in flight (the non-blocking path)."""
        for plan in self.manager.prefetch(ids):
            assert plan.dst_tier == 0 and plan.job_id in self.manager.inflight

    @precondition(_ready)
    @rule(ids=st.lists(IDS, min_size=1, max_size=6))
    def access_in_flight(self, ids):
        for plan in self.manager.access(ids, wait=False):
            assert plan.job_id in self.manager.inflight or self.manager.wait(plan.job_id) is None

    @precondition(_ready)
    @rule(block_all=st.booleans())
    def settle(self, block_all):
        """Completes started moves: whatever the engine finished, or all of them."""
        if block_all:
            self.manager.wait_all()
        else:
            self.manager.poll()

    @precondition(_ready)
    @rule(block=IDS)
    def ref(self, block):
        if self.manager.locate(block) is None:
            with pytest.raises(KeyError):
                self.manager.ref([block])
        else:
            self.manager.ref([block])
            self.refs[block] = self.refs.get(block, 0) + 1

    @precondition(_ready)
    @rule(block=IDS)
    def unref(self, block):
        if self.refs.get(block, 0) == 0:
            with pytest.raises(CountError):
                self.manager.unref([block])
            return
        self.manager.unref([block])
        self.refs[block] -= 1
        if not self.refs[block]:
            del self.refs[block]

    @precondition(_ready)
    @rule(block=IDS)
    def evict(self, block):
        if block in self.refs:
            with pytest.raises(CountError):
                self.manager.evict([block])
        elif not any(block in d.pins for d in self.manager.dirs):
            self.manager.evict([block])
            assert self.manager.locate(block) is None

    @precondition(_ready)
    @rule(tier=st.integers(0, 2), n=st.integers(1, 3))
    def make_room(self, tier, n):
        m = self.manager
        if tier < m.n_tiers:
            before = [len(d) for d in m.dirs]
            moving = dict(m.inflight)
            if not m.make_room(tier, n):
                # Nothing displaced: only moves in flight that it waited for (out of the tier,
                # to use the slots they free) may have landed.
                for job_id, plan in moving.items():
                    if job_id not in m.inflight and all(b in m.dirs[plan.dst_tier].slot_of for b in plan.ids):
                        before[plan.dst_tier] += len(plan.ids)
                        before[plan.src_tier] -= 0 if plan.keep_source else len(plan.ids)
                assert [len(d) for d in m.dirs] == before

    @precondition(_ready)
    @rule(data=st.data(), src=st.integers(0, 2), dst=st.integers(0, 2), keep=st.booleans())
    def transfer(self, data, src, dst, keep):
        m = self.manager
        if max(src, dst) >= m.n_tiers:
            return
        resident = sorted(m.dirs[src].slot_of)
        if not resident:
            return
        ids = data.draw(st.lists(st.sampled_from(resident), min_size=1, max_size=3, unique=True))
        if data.draw(st.booleans()):
            m.make_room(dst, len(ids), frozenset(ids))
        snapshot = [dict(d.slot_of) for d in m.dirs]
        pins = [dict(d.pins) for d in m.dirs]
        plan = m.prepare_move(ids, src, dst, keep_source=keep)
        if plan is None:
            assert [dict(d.slot_of) for d in m.dirs] == snapshot and [dict(d.pins) for d in m.dirs] == pins
            return
        assert src != dst and (m.write_through or not keep)
        self.held.append(plan.job_id)

    @precondition(lambda self: self.manager is not None and self.held)
    @rule(index=st.integers(0, 10), ok=st.booleans())
    def complete(self, index, ok):
        job_id = self.held.pop(index % len(self.held))
        plan = self.manager.inflight[job_id]
        self.manager.complete(JobResult(job_id, None if ok else "injected"))
        where = plan.dst_tier if ok else plan.src_tier
        assert all(b in self.manager.dirs[where].slot_of for b in plan.ids)

    @invariant()
    def consistent(self):
        if self.manager is None:
            return
        m = self.manager
        m.check_invariants()
        assert m.refs == self.refs
        assert all(len(d) <= d.capacity for d in m.dirs), "capacity exceeded"
        self.stats.consume(m.events.drain())
        if not m.write_through:
            # Exclusive: blocks enter only by insertion and leave only by a counted policy
            # decision (eviction, refusal on demotion counts as eviction too) or a loss.
            inserted = sum(t.inserts for t in self.stats.tiers)
            left = sum(t.evictions + t.lost for t in self.stats.tiers)
            assert sum(len(d) for d in m.dirs) == inserted - left, "a block vanished uncounted"


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
