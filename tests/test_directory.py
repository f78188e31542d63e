"""TierDirectory: memory per slot of capacity, the refusal of an impossible capacity, and
the free stack's handing-out order against a plain-list reference (issue 8 item 12)."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from tiercache.core import directory as directory_module
from tiercache.core.directory import SLOT_BYTES, CountError, TierDirectory
from tiercache.errors import UserError


def test_empty_directory_costs_at_most_16_bytes_per_slot():
    n = 1_000_000
    tracemalloc.start()
    try:
        directory = TierDirectory("hbm", n)
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert directory.n_free == n
    assert current / n <= 16.0, f"{current / n:.2f} B per slot"


def test_impossible_capacity_is_refused_with_the_bytes_it_needs():
    with pytest.raises(UserError, match=f"needs {10**12 * SLOT_BYTES:,} bytes"):
        TierDirectory("nvme", 10**12)


def test_capacity_over_available_memory_is_refused(monkeypatch):
    class Memory:
        available = 1 << 30

    monkeypatch.setattr(directory_module.psutil, "virtual_memory", lambda: Memory)
    with pytest.raises(ValueError, match=r"needs 2,147,483,648 bytes \(16 B per slot\); only 1,073,741,824"):
        TierDirectory("dram", 1 << 27)


class ListReference:
    """The former free stack: a plain list, top at the end, lowest slot on top at first."""

    def __init__(self, capacity: int) -> None:
        self.free = list(range(capacity - 1, -1, -1))

    def reserve(self, n: int) -> list[int]:
        taken = self.free[len(self.free) - n :][::-1]
        del self.free[len(self.free) - n :]
        return taken


@pytest.mark.parametrize("spill", [1, 3, 4096])
def test_slots_are_handed_out_in_the_list_stack_order(monkeypatch, spill):
    monkeypatch.setattr(directory_module, "SPILL_SLOTS", spill)
    rng = random.Random(spill)
    capacity, next_id = 64, 0
    directory, reference = TierDirectory("t", capacity), ListReference(capacity)
    for _ in range(600):
        resident = list(directory.slot_of)
        if resident and rng.random() < 0.45:
            ids = rng.sample(resident, rng.randint(1, min(len(resident), 9)))
            reference.free.extend(directory.remove(ids))
        elif directory.n_free and rng.random() < 0.2:
            slots = directory.reserve(rng.randint(1, min(directory.n_free, 9)))
            assert slots == reference.reserve(len(slots))
            directory.release(slots[::-1])
            reference.free.extend(slots[::-1])
        elif directory.n_free:
            n = rng.randint(1, min(directory.n_free, 12))
            ids = list(range(next_id, next_id + n))
            next_id += n
            assert directory.insert(ids) == reference.reserve(n)
        directory.check_invariants()
        assert directory.n_free == len(reference.free)


def test_claim_keeps_the_order_of_the_other_free_slots(monkeypatch):
    monkeypatch.setattr(directory_module, "SPILL_SLOTS", 2)
    directory = TierDirectory("t", 10)
    directory.insert([100, 101, 102, 103, 104])
    directory.remove([101, 104, 102])  # free stack: 9 8 7 6 5 1 4 2 (top)
    directory.claim([7, 8], [4, 6])
    directory.check_invariants()
    assert directory.slot_of[7] == 4 and directory.n_free == 6
    assert directory.insert([20, 21, 22, 23, 24, 25]) == [2, 1, 5, 7, 8, 9]
    with pytest.raises(CountError):
        directory.insert([30])


def test_claim_refuses_a_slot_that_is_not_free():
    directory = TierDirectory("t", 4)
    directory.insert([1])
    with pytest.raises(CountError, match="not free"):
        directory.claim([2], [0])
    with pytest.raises(CountError, match="repeated"):
        directory.claim([2, 3], [1, 1])
    directory.check_invariants()


def test_claim_refuses_a_slot_out_of_range():
    directory = TierDirectory("t", 4)
    with pytest.raises(CountError, match="not free"):
        directory.claim([2], [4])
    directory.check_invariants()
    assert directory.insert([5, 6]) == [0, 1]


def test_invariant_check_of_a_huge_tier_costs_what_it_holds():
    """A tier of 10**9 slots holding a few blocks checks in O(blocks), not O(slots): a replay
    of a tiny trace with a huge tier ends with this check (it took 30 s and 9.8 GB before)."""
    import time
    import tracemalloc

    directory = TierDirectory("dram", 10**9)
    slots = directory.reserve(5)
    directory.publish([10, 11, 12, 13, 14], slots)
    directory.remove([12])
    tracemalloc.start()
    started = time.perf_counter()
    directory.check_invariants()
    elapsed = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20 and elapsed < 1.0


@pytest.mark.parametrize("corrupt", ["fresh_past_capacity", "slot_freed_twice", "slot_above_fresh", "lost_slot"])
def test_invariant_check_catches_a_corrupt_free_stack(corrupt):
    directory = TierDirectory("hbm", 16)
    directory.publish([1, 2, 3], directory.reserve(3))
    directory.remove([2])
    directory.check_invariants()
    if corrupt == "fresh_past_capacity":
        directory._fresh = 17
    elif corrupt == "slot_freed_twice":
        directory._spill.append(directory._spill[-1])
        directory.n_free += 1
    elif corrupt == "slot_above_fresh":
        directory._spill[-1] = 9
    else:
        directory._spill.pop()
    with pytest.raises(AssertionError, match="hbm: "):  # the directory's own check, naming the tier
        directory.check_invariants()
