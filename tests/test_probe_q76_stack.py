"""Probe Q76-5: the compiled LRU stack-distance walk (``tiercache.sim.stackdist``).

Its distances and histograms must equal, bit for bit, an explicit LRU stack and the numpy
wavelet path that ``mrc`` keeps for runs without numba; its memory must stay a few bytes per
access (the wavelet pass peaked at ~100 B per access).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.policies.base import NO_NEXT_USE
from tiercache.policies.kernels import HAVE_NUMBA
from tiercache.sim import mrc, stackdist, tracestats
from tiercache.sim.traces import next_use

#: Multipliers of the drawn ids: dense ids take the table path, spread ones the hash path.
SPREADS = (1, 7, 1_000_003, 1 << 40)


def lru_stack_distances(ids) -> list[int]:
    """Reference: an explicit LRU stack, most recent first; distance = 1-based depth, 0 if absent."""
    stack: list[int] = []
    out = []
    for block in ids:
        depth = stack.index(block) + 1 if block in stack else 0
        if depth:
            del stack[depth - 1]
        stack.insert(0, block)
        out.append(depth)
    return out


traces = st.builds(
    lambda raw, spread, shift: (np.array(raw, dtype=np.int64) * spread - shift),
    st.lists(st.integers(0, 40), max_size=250), st.sampled_from(SPREADS), st.sampled_from((0, 5, -(1 << 50))),
)


@settings(max_examples=300, deadline=None)
@given(ids=traces)
def test_compiled_distances_equal_an_lru_stack_and_the_numpy_path(ids):
    expected = lru_stack_distances(ids.tolist())
    nxt = stackdist.next_positions(ids)
    assert stackdist.walk_distances(nxt).tolist() == expected
    assert stackdist.walk_distances(nxt.astype(np.int64)).tolist() == expected  # int64 positions (2**31 accesses on)
    assert stackdist.walk_distances(next_use(ids)).tolist() == expected  # NO_NEXT_USE as "none"
    assert mrc._wavelet_distances(mrc.previous_access(ids)).tolist() == expected
    assert mrc.stack_distances(ids).tolist() == expected


@settings(max_examples=300, deadline=None)
@given(ids=traces, seed=st.integers(0, 2**32 - 1))
def test_histograms_equal_bincount_of_the_reference(ids, seed):
    expected = np.array(lru_stack_distances(ids.tolist()), dtype=np.int64)
    touched = np.random.default_rng(seed).random(ids.size) < 0.6
    counts = mrc.distance_counts(ids)
    assert counts.dtype == np.int64
    assert counts.tolist() == np.bincount(expected, minlength=1).tolist()
    of_touched = np.bincount(expected[touched], minlength=1).tolist()
    assert mrc.distance_counts(ids, touched).tolist() == of_touched
    assert mrc.distance_counts(ids, touched, next_use(ids)).tolist() == of_touched
    histogram = mrc.reuse_histogram(ids)
    assert histogram.cold == int(np.sum(expected == 0)) and histogram.accesses == ids.size
    assert histogram.counts.tolist() == [0] + np.bincount(expected, minlength=1).tolist()[1:]
    with pytest.MonkeyPatch.context() as patch:  # the numpy path (no numba)
        patch.setattr(mrc, "HAVE_NUMBA", False)
        assert mrc.distance_counts(ids).tolist() == counts.tolist()
        assert mrc.distance_counts(ids, touched, next_use(ids)).tolist() == of_touched


def _next_use_or_minus_one(ids: np.ndarray) -> list[int]:
    expected = next_use(ids)
    expected[expected == NO_NEXT_USE] = -1
    return expected.tolist()


def test_next_positions_by_table_and_by_hash_agree():
    rng = np.random.default_rng(5)
    dense = rng.integers(0, 300, 5000).astype(np.int64)
    for ids in (dense, dense * (1 << 40) + 3, -dense * 1_000_003):  # spans far above 2 per access: hashed
        got = stackdist.next_positions(ids)
        assert got.dtype == np.int32 and got.tolist() == _next_use_or_minus_one(dense)


def test_hash_probing_wraps_around_a_crowded_table():
    """16 slots for 15 distinct ids, 5 of them hashed to the last slot: probe runs past the last
    slot, back to the first."""
    candidates = np.arange(1, 2000, dtype=np.int64) * 0x5851F42D4C957F2D
    with np.errstate(over="ignore"):
        home = (candidates.astype(np.uint64) * stackdist._GOLDEN) >> np.uint64(60)
    distinct = np.concatenate((candidates[home == 15][:5], candidates[home < 15][:10]))
    ids = np.random.default_rng(8).choice(distinct, 400)
    table = np.full(16, -1, dtype=np.int32)
    nxt = np.empty(ids.size, dtype=np.int32)
    with np.errstate(over="ignore"):
        assert stackdist._next_by_hash(ids, table, np.uint64(60), nxt, np.int64(10**6))
    assert nxt.tolist() == _next_use_or_minus_one(ids)
    assert np.sort(table).tolist() == [-1] + sorted(np.unique(ids, return_index=True)[1].tolist())


def test_numba_off_path_gives_the_same(monkeypatch):
    rng = np.random.default_rng(11)
    ids = (rng.zipf(1.3, 4000) % 700).astype(np.int64)
    touched = rng.random(ids.size) < 0.5
    compiled = (mrc.stack_distances(ids), mrc.distance_counts(ids, touched, next_use(ids)), mrc.reuse_histogram(ids))
    monkeypatch.setattr(mrc, "HAVE_NUMBA", False)
    monkeypatch.setattr(stackdist, "_walk", None)  # the numpy path must not touch the walk
    plain = (mrc.stack_distances(ids), mrc.distance_counts(ids, touched, next_use(ids)), mrc.reuse_histogram(ids))
    for got, want in zip(plain[:2], compiled[:2]):
        assert got.dtype == want.dtype and got.tolist() == want.tolist()
    assert (plain[2].counts.tolist(), plain[2].cold, plain[2].accesses) == \
        (compiled[2].counts.tolist(), compiled[2].cold, compiled[2].accesses)


def test_no_numba_environment_takes_the_numpy_path():
    code = ("import numpy as np; from tiercache.sim import mrc; assert not mrc.HAVE_NUMBA; "
            "print(mrc.stack_distances(np.array([7, 8, 7, 9, 8, 8, 7])).tolist())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TIERCACHE_NO_NUMBA": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0, 0, 2, 0, 3, 1, 3]"


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(0, 30) | st.integers(0, 5000), min_size=1, max_size=40), zeros=st.integers(0, 3))
def test_percentiles_of_counts_equal_numpy_percentile(counts, zeros):
    counts = np.array(counts + [0] * zeros, dtype=np.int64)  # trailing zeros: the max is not the last
    values = np.repeat(np.arange(counts.size), counts)
    assert tracestats._pct_of_counts(counts) == tracestats._pct(values)  # exact floats


def _peak_bytes(call) -> int:
    """Peak traced allocation (numpy reports its buffers to tracemalloc) of ``call()``."""
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.skipif(not HAVE_NUMBA, reason="the memory bound is the compiled walk's")
def test_two_million_accesses_stay_within_a_few_bytes_each():
    """The wavelet pass peaked at ~100 B per access; the walk keeps a next-position array and
    a tree (4 B each) and the answer (8 B per access for distances, 8 per distinct id for counts)."""
    n = 2_000_000
    rng = np.random.default_rng(3)
    ids = (rng.zipf(1.2, n) % (n // 4)).astype(np.int64)
    for spread in (ids, ids * 0x5851F42D4C957F2D):  # the table path, the hash path
        mrc.reuse_histogram(spread[:1000])  # loads the compiled code outside the measure
        assert _peak_bytes(lambda: mrc.reuse_histogram(spread)) < 16 * n
        assert _peak_bytes(lambda: mrc.stack_distances(spread)) < 20 * n
    following = next_use(ids)
    assert _peak_bytes(lambda: mrc.distance_counts(ids, None, following)) < 8 * n


def test_a_mask_of_another_length_is_refused():
    ids = np.array([1, 2, 1], dtype=np.int64)
    with pytest.raises(ValueError):
        stackdist.walk_counts(stackdist.next_positions(ids), np.ones(2, dtype=bool))
    with pytest.raises(ValueError):
        stackdist.walk_counts(stackdist.next_positions(ids), np.ones(0, dtype=bool))
