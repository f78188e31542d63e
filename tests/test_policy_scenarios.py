"""Exact-id scenarios: small hand-computed sequences and the ids each policy must evict.

Ids are letters for readability (``A`` = 1, ...). "Trace" scenarios go through
``policy_driver.run`` (evict one victim, then insert, like libCacheSim); the others call the
hooks directly.
"""

from __future__ import annotations

import pytest
from policy_driver import from_ids, run

from tiercache.policies import NO_NEXT_USE, Hints, make_admission, make_eviction
from tiercache.policies.admission_second_hit import SecondHitAdmit

A, B, C, D, E, F, G, H, I, J = range(1, 11)


def evictions(name: str, capacity: int, ids: list[int], parents: list[int | None] | None = None) -> list[int]:
    """The ids evicted, in order, when ``ids`` is replayed at ``capacity``."""
    policy = make_eviction(name, capacity)
    return [v for v in run(policy, from_ids(ids, parents), check_every=1) if v is not None]


def filled(name: str, capacity: int, ids: list[int], hints: Hints | None = None):
    policy = make_eviction(name, capacity)
    policy.on_insert(ids, hints)
    return policy


# LRU / FIFO / LFU: the shared priority driver -------------------------------------------------


def test_lru_evicts_least_recent() -> None:
    assert evictions("lru", 3, [A, B, C, B, D]) == [A]
    policy = filled("lru", 3, [A, B, C])
    policy.on_access([B])
    assert policy.victims(3) == [A, C, B]
    assert policy.victims(2, protected={A}) == [C, B]


def test_fifo_ignores_hits() -> None:
    assert evictions("fifo", 3, [A, B, C, A, D, A]) == [A, B]


def test_lfu_counts_then_recency() -> None:
    policy = filled("lfu", 3, [A, B, C])
    policy.on_access([A, A, B])
    assert policy.victims(3) == [C, B, A]
    tie = filled("lfu", 3, [A, B, C])
    tie.on_access([C])
    tie.on_access([A])
    assert tie.victims(3) == [B, C, A]  # C and A both at 2 hits: C was used less recently
    # The newcomer has the lowest count, so LFU evicts it first (why it is not batch-safe).
    assert evictions("lfu", 3, [A, A, B, B, C, D, E]) == [C, D]


# SIEVE --------------------------------------------------------------------------------------


def test_sieve_hand_sweeps_and_wraps() -> None:
    policy = filled("sieve", 4, [A, B, C, D])  # oldest A ... newest D
    policy.on_access([A, C])
    assert policy.victims(1) == [B]  # hand: A (clears), B
    policy.on_remove([B])  # hand rests on C
    policy.on_insert([E])
    policy.on_access([A])
    assert policy.victims(1) == [D]  # starts at C (clears), D; A keeps its bit
    policy.on_remove([D])
    assert policy.victims(1) == [E]  # the hand moved on to E: the newest block goes first
    policy.on_remove([E])
    assert policy.victims(1) == [C]  # wrapped to the tail: A (clears), C
    policy.check_invariants()


def test_sieve_batch_equals_sequential() -> None:
    policy = filled("sieve", 4, [A, B, C, D])
    policy.on_access([A, C])
    assert policy.victims(2) == [B, D]
    assert filled("sieve", 2, [A, B]).victims(1, protected={A}) == [B]


# Belady -------------------------------------------------------------------------------------


def test_belady_evicts_farthest_next_use() -> None:
    policy = filled("belady", 3, [A, B, C], Hints(next_use=[10, 5, NO_NEXT_USE]))
    assert policy.victims(1) == [C]
    assert policy.victims(3) == [C, A, B]
    assert policy.victims(1, protected={C}) == [A]
    policy.on_access([B], Hints(next_use=[99]))
    assert policy.victims(2) == [C, B]
    assert policy.next_use(B) == 99
    with pytest.raises(ValueError):
        policy.on_access([A])  # Belady cannot run without its hint


def test_belady_on_a_trace() -> None:
    # Capacity 2: at C, A is next used at t=3 and B at t=6, so B goes; at D, C is never used
    # again while A is used at t=5.
    assert evictions("belady", 2, [A, B, C, A, D, A]) == [B, C]


# ARC ----------------------------------------------------------------------------------------


def test_arc_ghost_hits_adapt_target() -> None:
    trace = [A, B, C, D, A, B, E, C, F, A]
    policy = make_eviction("arc", 4)
    evicted = run(policy, from_ids(trace[:8]), check_every=1)
    assert [v for v in evicted if v is not None] == [C, D]
    assert policy.target_t1 == 1.0  # C hit its B1 ghost: T1 may grow
    # With p = 1 and |T1| = 1, REPLACE now takes T2's LRU (A), not T1's (E).
    evicted = run(policy, from_ids([F]), check_every=1)
    assert evicted == [A]
    run(policy, from_ids([A]), check_every=1)  # A hits its B2 ghost: T1 shrinks back
    assert policy.target_t1 == 0.0
    assert evictions("arc", 4, trace) == [C, D, A, E]


def test_arc_frequency_list_survives_a_scan() -> None:
    hot, scan = [A, B], list(range(100, 120))
    survivors = make_eviction("arc", 4)
    run(survivors, from_ids(hot + hot + scan), check_every=1)
    assert A in survivors and B in survivors
    lru = make_eviction("lru", 4)
    run(lru, from_ids(hot + hot + scan))
    assert A not in lru and B not in lru


# S3-FIFO ------------------------------------------------------------------------------------


def _s3fifo_warm() -> object:
    """Capacity 10 (small 1, main 9): A in small, B..J in main (small was full before any
    eviction, so libCacheSim's rule sends them to main), no hits yet."""
    policy = make_eviction("s3fifo", 10)
    run(policy, from_ids([A, B, C, D, E, F, G, H, I, J]))
    assert not policy.in_main(A) and all(policy.in_main(b) for b in range(B, J + 1))
    return policy


def test_s3fifo_filters_one_hit_wonders() -> None:
    policy = _s3fifo_warm()
    scan = list(range(100, 120))
    evicted = run(policy, from_ids(scan), check_every=1)
    assert evicted == [A, *scan[:-1]]  # each newcomer only displaces the previous one
    assert all(b in policy for b in range(B, J + 1))
    run(policy, from_ids([118]), check_every=1)  # 118 is in the ghost: it returns to main
    assert policy.in_main(118) and 119 not in policy


def test_s3fifo_promotes_on_the_second_hit() -> None:
    twice = _s3fifo_warm()
    twice.on_access([A, A])
    assert twice.victims(1) == [B]  # A moves to main; main is over its share, B's bit is spent
    assert twice.in_main(A)
    once = _s3fifo_warm()
    once.on_access([A])
    assert once.victims(1) == [A]  # one hit is below libCacheSim's threshold of 2


# leaf_lru -----------------------------------------------------------------------------------


def _chain() -> object:
    """R=A -> B -> C is one prefix (C the leaf); D is an unrelated root inserted last."""
    policy = make_eviction("leaf_lru", 8)
    policy.on_insert([A, B, C], Hints(parents=[None, A, B]))
    policy.on_insert([D], Hints(parents=[None]))
    return policy


def test_leaf_lru_evicts_leaves_before_parents() -> None:
    policy = _chain()
    assert policy.victims(1) == [C]
    assert policy.victims(4) == [C, B, A, D]  # the chain unwinds leaf-first
    assert filled("lru", 8, [A, B, C, D]).victims(4) == [A, B, C, D]
    policy.on_access([A])  # a recent parent is still not a candidate
    assert policy.victims(1) == [C]
    policy.on_remove([C])  # B becomes a leaf, older than D
    assert policy.victims(1) == [B]


def test_leaf_lru_falls_back_to_lru_when_leaves_are_protected() -> None:
    policy = _chain()
    policy.on_access([A])  # LRU order: B, C, D, A
    assert policy.victims(2, protected={C}) == [D, B]
    assert policy.victims(4, protected={C}) is None


def test_leaf_lru_children_before_parent_and_trace() -> None:
    policy = make_eviction("leaf_lru", 4)
    policy.on_insert([C], Hints(parents=[B]))  # parent not tracked yet
    policy.on_insert([B], Hints(parents=[None]))
    assert policy.victims(2) == [C, B]
    # A request A-B-C, then A again: LRU evicts B and strands C; leaf_lru evicts the leaf C.
    ids, parents = [A, B, C, A, D], [None, A, B, None, None]
    assert evictions("lru", 3, ids, parents) == [B]
    assert evictions("leaf_lru", 3, ids, parents) == [C]


# second_hit admission -----------------------------------------------------------------------


def test_second_hit_admits_on_second_sighting_within_history() -> None:
    policy = SecondHitAdmit(history=2)
    assert policy.admit([A]) == [False]
    assert policy.admit([A]) == [True]
    assert policy.admit([B, C]) == [False, False]  # A ages out (FIFO of 2 first sightings)
    assert policy.admit([A, A]) == [False, True]
    assert policy.admit([C]) == [True]
    policy.check_invariants()
    assert make_admission("always").admit([A, A]) == [True, True]
    with pytest.raises(ValueError):
        SecondHitAdmit(history=0)
