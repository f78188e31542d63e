"""The manager's non-blocking move API: start, poll, wait, prefetch, access(wait=False).

Also the simulator's side of it: a prefetching stub replayed on ``SimEngine`` overlaps its
transfers with modeled compute and with each other, through the same calls the live store
makes.
"""

from __future__ import annotations

import pytest

from tiercache.core.engine import ImmediateEngine
from tiercache.core.manager import TierManager
from tiercache.core.plans import EventLog, JobResult
from tiercache.policies import make_admission, make_eviction
from tiercache.sim.engine import SimClock, SimEngine
from tiercache.sim.hardware import HardwareProfile, Link


def manager(caps, engine=None, events=None, write_through=False):
    tiers = list(zip(("hbm", "dram", "nvme"), caps))
    return TierManager(tiers, [make_eviction("lru", c) for _, c in tiers],
                       [make_admission("always") for _ in tiers], engine=engine, events=events, write_through=write_through)


def contents(m: TierManager) -> list[list[int]]:
    return [sorted(d.slot_of) for d in m.dirs]


def fill(m: TierManager, n: int, first: int = 1) -> None:
    """Stores blocks first..first+n-1 one at a time (each demotes the oldest)."""
    for block_id in range(first, first + n):
        m.access([block_id])


class HeldEngine(ImmediateEngine):
    """Finishes a job only when the test releases it (an engine with real latency)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[int, JobResult] = {}
        self.released: set[int] = set()

    def submit(self, plan) -> None:
        self.submitted += 1
        self.held[plan.job_id] = JobResult(plan.job_id)

    def poll(self):
        done = [self.held.pop(j) for j in sorted(self.released) if j in self.held]
        self.released.clear()
        return done

    def wait(self, job_id):
        return self.held.pop(job_id)


def test_start_move_publishes_only_when_polled():
    engine = HeldEngine()
    m = manager([2, 2], engine=engine)
    m.access([1, 2, 3])  # hbm {2, 3}, dram {1}
    plan = m.start_move([1], 1, 0) if m.make_room(0, 1, frozenset([1])) else None
    assert plan is not None and engine.submitted >= 1
    assert m.locate(1) == 1 and m.dirs[1].pins == {1: 1}  # still found where it was
    m.check_invariants()
    assert m.poll() == []
    engine.released.add(plan.job_id)
    assert [p.job_id for p in m.poll()] == [plan.job_id]
    assert m.locate(1) == 0 and m.dirs[1].pins == {}
    m.check_invariants()


def test_wait_on_a_job_already_completed_by_poll_is_a_no_op():
    engine = HeldEngine()
    m = manager([2, 2], engine=engine)
    m.access([1, 2, 3])
    (plan,) = m.prefetch([1])
    engine.released.add(plan.job_id)
    m.poll()  # someone else (stats, another access) completed it
    assert m.wait(plan.job_id) is None and m.locate(1) == 0
    assert m.wait_all() == []
    m.check_invariants()


def test_prefetch_skips_top_absent_and_moving_blocks():
    engine = HeldEngine()
    m = manager([2, 2, 4], engine=engine)
    fill(m, 6)  # [[5, 6], [3, 4], [1, 2]]
    plans = m.prefetch([6, 99, 3, 1])
    assert sorted((p.src_tier, p.ids) for p in plans) == [(1, (3,)), (2, (1,))]
    assert m.prefetch([3, 1]) == []  # already moving: not started twice
    assert len(m.wait_all()) == 2
    assert 3 in m.dirs[0] and 1 in m.dirs[0]
    m.check_invariants()


def test_access_without_waiting_returns_the_promotions_in_flight():
    engine = HeldEngine()
    m = manager([2, 2], engine=engine)
    m.access([1, 2, 3])  # hbm {2, 3}, dram {1}
    plans = m.access([1], wait=False)
    assert [p.ids for p in plans] == [(1,)] and m.locate(1) == 1
    m.check_invariants()
    result = m.wait(plans[0].job_id)
    assert result.ok and m.locate(1) == 0
    assert m.access([2], wait=True) == []  # a blocking access leaves nothing in flight
    assert not m.inflight
    m.check_invariants()


def test_a_failed_engine_submit_leaves_nothing_pinned():
    class Refusing(ImmediateEngine):
        def submit(self, plan):
            raise RuntimeError("queue full")

    m = manager([2, 2])
    m.access([1, 2, 3])
    m.engine = Refusing()
    assert m.prefetch([1]) == [] and m.locate(1) == 1
    assert not m.inflight and m.dirs[1].pins == {}
    m.check_invariants()


def test_inserts_publish_only_after_the_bytes_landed():
    class FailingFill(ImmediateEngine):
        def __init__(self):
            super().__init__()
            self.seen = []

        def fill(self, tier, ids, slots):
            self.seen.append([m.locate(b) for b in ids])  # not yet visible while written
            if 7 in ids:
                raise KeyboardInterrupt  # even an interrupt leaves nothing behind

    engine = FailingFill()
    m = manager([2, 2], engine=engine)
    m.access([1, 2])
    with pytest.raises(KeyboardInterrupt):
        m.access([7])
    assert engine.seen[-1] == [None] and m.locate(7) is None
    assert contents(m) == [[2], [1]]  # room was made (a legitimate demotion), 7 never placed
    m.check_invariants()
    m.access([8])
    m.check_invariants()


def test_departures_are_events_the_caller_drains():
    events = EventLog(record_departures=True)
    m = manager([1, 1], events=events)
    m.access([1, 2, 3])  # 1 leaves the hierarchy
    assert events.drain_departed() == [1] and events.drain_departed() == []
    quiet = manager([1, 1])
    quiet.access([1, 2, 3])
    assert quiet.events.drain_departed() == []  # replays do not pay for the list


PROFILE = HardwareProfile("toy", {
    "dram->hbm": Link(1e9, 0.0), "hbm->dram": Link(1e9, 0.0),
    "nvme->dram": Link(0.5e9, 0.0), "dram->nvme": Link(0.5e9, 0.0),
    "nvme->hbm": Link(0.5e9, 0.0),
}, prefill_tokens_per_s=1e4)
BLOCK = 1_000_000  # bytes: 1 ms over dram->hbm, 2 ms over nvme->hbm


class TopKStub:
    """A prefetch policy stub: at each step it predicts the next step's blocks."""

    def __init__(self, schedule):
        self.schedule = schedule

    def plan(self, step: int) -> list[int]:
        return self.schedule[step + 1] if step + 1 < len(self.schedule) else []


def decode_replay(prefetcher, compute_s: float):
    """Replays a step schedule; each step reads its blocks after ``compute_s`` of compute.

    Returns (modeled seconds, blocks already in HBM when read, jobs overlapping in time).
    """
    clock = SimClock()
    engine = SimEngine(("hbm", "dram", "nvme"), BLOCK, PROFILE, clock)
    m = manager([8, 4, 16], engine=engine)
    fill(m, 20, first=0)  # HBM 12..19, DRAM 8..11, NVMe 0..7
    schedule = [[0, 1, 2], [4, 5, 6], [8, 9, 10]]
    ready, spans = 0, []
    for step, blocks in enumerate(schedule):
        if prefetcher is not None:
            for plan in m.prefetch(prefetcher.plan(step)):
                spans.append(clock.now)
        clock.advance_to(clock.now + compute_s)  # attention of this step runs meanwhile
        m.poll()
        ready += sum(b in m.dirs[0] for b in schedule[step])
        m.access(blocks)  # blocking: waits for whatever is still missing
        m.check_invariants()
    return clock.now, ready, len(spans)


def test_a_prefetching_stub_overlaps_transfers_with_compute_in_simulated_time():
    compute = 0.004
    without, ready_without, _ = decode_replay(None, compute)
    with_prefetch, ready_with, started = decode_replay(TopKStub([[0, 1, 2], [4, 5, 6], [8, 9, 10]]), compute)
    assert started >= 2  # plans went through manager.prefetch on the SimEngine
    assert ready_with > ready_without  # blocks were in HBM before the step read them
    assert with_prefetch < without  # fetches hid behind compute instead of adding to it


def test_moves_on_different_links_overlap_in_simulated_time():
    clock = SimClock()
    engine = SimEngine(("hbm", "dram", "nvme"), BLOCK, PROFILE, clock)
    m = manager([8, 2, 8], engine=engine)
    fill(m, 12, first=0)  # hbm 4..11, dram 2, 3, nvme 0, 1
    m.evict(list(range(4, 12)))  # room in HBM, nothing to demote
    busy_before, start = engine.total_seconds(), clock.now
    plans = m.prefetch([0, 1, 2, 3])
    assert sorted(p.src_tier for p in plans) == [1, 2]
    m.wait_all()
    assert engine.total_seconds() - busy_before == pytest.approx(2 * 0.001 + 2 * 0.002)
    assert clock.now - start == pytest.approx(0.004)  # the two links ran side by side
    assert contents(m)[0] == [0, 1, 2, 3]
    m.check_invariants()
