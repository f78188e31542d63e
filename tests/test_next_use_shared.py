"""``traces.next_use`` and ``stackdist.next_positions`` are one computation, and ids built to
collide in ``next_positions``' hash set cost a sort, not a quadratic walk."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tiercache.policies.base import NO_NEXT_USE
from tiercache.sim import stackdist
from tiercache.sim.traces import next_use

#: The multiplicative inverse of the hash's constant: ``i * INVERSE`` hashes to ``i``'s top
#: bits, so the ids ``0, INVERSE, 2 * INVERSE, ...`` all land in slot 0.
INVERSE = pow(int(stackdist._GOLDEN), -1, 2**64)


def colliding(n: int) -> np.ndarray:
    """``n`` distinct int64 ids that share the hash set's home slot at every table size."""
    return np.array([(i * INVERSE) % 2**64 for i in range(n)], dtype=np.uint64).view(np.int64)


def reference(ids) -> list[int]:
    """Next use by a plain scan from the end."""
    later, out = {}, []
    for i in range(len(ids) - 1, -1, -1):
        out.append(later.get(ids[i], NO_NEXT_USE))
        later[ids[i]] = i
    return out[::-1]


@pytest.mark.parametrize("span", [50, 10**6, 2**62])
@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.int32])
def test_next_use_matches_a_plain_scan(span, dtype):
    rng = np.random.default_rng(span % 997)
    for size in (0, 1, 2, 500, 5000):
        ids = rng.integers(0, min(span, np.iinfo(dtype).max), size).astype(dtype)
        got = next_use(ids)
        assert got.dtype == np.int64
        assert got.tolist() == reference(ids.tolist())


def test_next_use_of_ids_that_are_not_integers_still_sorts():
    assert next_use(np.array(["a", "b", "a"])).tolist() == [2, NO_NEXT_USE, NO_NEXT_USE]


def test_the_hash_set_gives_up_on_ids_built_to_collide():
    ids = colliding(3000)
    bits = 13
    table = np.full(1 << bits, -1, dtype=np.int32)
    nxt = np.empty(ids.size, dtype=np.int32)
    with np.errstate(over="ignore"):
        assert not stackdist._next_by_hash(ids, table, np.uint64(64 - bits), nxt, np.int64(16 * ids.size))


def test_colliding_ids_take_a_sort_not_a_quadratic_walk():
    n = 100_000
    ids = np.concatenate([colliding(n), colliding(n)])
    stackdist.next_positions(ids[:10])  # compiled before the clock starts
    start = time.perf_counter()
    nxt = stackdist.next_positions(ids)
    elapsed = time.perf_counter() - start
    assert nxt[:n].tolist() == list(range(n, 2 * n)) and (nxt[n:] == -1).all()
    assert elapsed < 2.0, f"{elapsed:.1f} s: the walk probed each id past every earlier one (8.8 s before the guard)"
