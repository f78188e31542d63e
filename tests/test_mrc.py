"""One-pass LRU miss-ratio curve (tiercache.sim.mrc) against per-capacity LRU replays."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from tiercache.sim.mrc import _earlier_greater, lru_miss_ratio_curve, previous_access, reuse_histogram, stack_distances

SAMPLE_TRACE = Path(__file__).parent / "data" / "mooncake_synthetic_trace.jsonl"


def lru_misses(ids, capacity: int) -> int:
    """Reference: a plain OrderedDict LRU that inserts on every miss."""
    cache: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for block in ids.tolist():
        if block in cache:
            cache.move_to_end(block)
            continue
        misses += 1
        cache[block] = None
        if len(cache) > capacity:
            cache.popitem(last=False)
    return misses


def test_stack_distances_of_a_small_trace():
    ids = np.array([7, 8, 7, 9, 8, 8, 7], dtype=np.int64)
    # 7: cold; 8: cold; 7: {8} between -> 2; 9: cold; 8: {7, 9} -> 3; 8: nothing -> 1; 7: {9, 8} -> 3
    assert stack_distances(ids).tolist() == [0, 0, 2, 0, 3, 1, 3]
    assert previous_access(ids).tolist() == [0, 0, 1, 0, 2, 5, 3]


def test_earlier_greater_matches_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(50):
        values = rng.integers(0, rng.integers(1, 100), rng.integers(0, 80))
        expected = [int(np.sum(values[:i] > v)) for i, v in enumerate(values)]
        assert _earlier_greater(values).tolist() == expected


@pytest.mark.parametrize("seed", range(20))
def test_curve_equals_per_capacity_replays_on_random_traces(seed):
    rng = np.random.default_rng(seed)
    universe = int(rng.integers(1, 80))
    ids = rng.integers(0, universe, int(rng.integers(0, 400))).astype(np.int64) * 1_000_003  # sparse ids
    capacities = [1, 2, 3, 5, 8, 13, 40, 100, 1000]
    ratios, histogram = lru_miss_ratio_curve(ids, capacities)
    expected = [lru_misses(ids, c) for c in capacities]
    assert histogram.misses(capacities).tolist() == expected
    if ids.size:
        np.testing.assert_array_equal(ratios, np.array(expected) / ids.size)
    assert histogram.cold == np.unique(ids).size
    assert histogram.cold + int(histogram.counts.sum()) == ids.size == histogram.accesses


def test_curve_on_skewed_trace_with_long_distances():
    rng = np.random.default_rng(7)
    ids = (rng.zipf(1.3, 5000) % 3000).astype(np.int64)
    capacities = [1, 10, 100, 500, 1000, 2999, 3000, 10_000]
    histogram = reuse_histogram(ids)
    assert histogram.misses(capacities).tolist() == [lru_misses(ids, c) for c in capacities]


def test_sample_trace_matches_replays():
    if not SAMPLE_TRACE.exists():
        pytest.skip(f"sample trace not found at {SAMPLE_TRACE}")
    with SAMPLE_TRACE.open() as lines:
        ids = np.array([b for line in lines if line.strip() for b in json.loads(line)["hash_ids"]], dtype=np.int64)
    capacities = [1, 100, 1000, 4000, 16000, 100_000]
    histogram = reuse_histogram(ids)
    assert histogram.misses(capacities).tolist() == [lru_misses(ids, c) for c in capacities]
    assert histogram.misses([histogram.max_useful_capacity])[0] == histogram.cold


def test_edge_cases():
    empty = reuse_histogram(np.array([], dtype=np.int64))
    assert empty.accesses == 0 and empty.cold == 0
    assert empty.miss_ratios([1, 10]).tolist() == [1.0, 1.0]
    single = reuse_histogram(np.array([5, 5, 5], dtype=np.int64))
    assert single.misses([0, 1, 2]).tolist() == [3, 1, 1]
    assert single.max_useful_capacity == 1
    with pytest.raises(ValueError):
        single.misses([-1])


def test_curve_is_monotone_in_capacity():
    rng = np.random.default_rng(3)
    histogram = reuse_histogram(rng.integers(0, 500, 4000))
    misses = histogram.misses(np.arange(0, 600))
    assert np.all(np.diff(misses) <= 0)
    assert misses[-1] == histogram.cold
