"""``scripts/class_bound.py``: the hindsight class ranking evicts only leaves, agrees with
Belady when nothing is evicted, and its rows lie between Belady and a full miss."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAD = ROOT / "tests" / "data" / "mooncake_head.jsonl"


@pytest.fixture(scope="module")
def bound():
    spec = importlib.util.spec_from_file_location("class_bound", ROOT / "scripts" / "class_bound.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hits(bound, requests: list[list[int]], capacity: int, rich: bool = False) -> list[bool]:
    ids = [b for r in requests for b in r]
    offsets = [0]
    for r in requests:
        offsets.append(offsets[-1] + len(r))
    classes = bound.classes_of(ids, offsets, rich)
    edges = bound.age_edges(capacity, 4.0)
    tables = bound.density_tables(bound.next_uses(ids), classes, edges)
    return bound.ranked_hits(ids, offsets, capacity, classes, tables, edges).tolist()


def test_only_leaves_are_evicted(bound) -> None:
    # inserting 4 into a full cache of the path 1-2-3 can only take the leaf 3: the prefix 1-2 then hits
    assert _hits(bound, [[1, 2, 3], [4], [1, 2]], 3) == [False] * 4 + [True, True]


def test_without_evictions_every_reuse_hits(bound) -> None:
    requests = [[1, 2], [1, 3], [4], [1, 2, 5]]
    assert _hits(bound, requests, 10, rich=True) == [False, False, True, False, False, True, True, False]


def test_classes_and_densities(bound) -> None:
    ids, offsets = [7, 8, 9, 7, 8], [0, 3, 5]
    assert bound.classes_of(ids, offsets, False) == [(0, 0), (0, 0), (0, 0), (1, 1), (1, 1)]
    # length 3 -> 4**0, to the end 2, 1, 0, depth 2**0, 2**1, 2**1; then length 2
    assert bound.classes_of(ids, offsets, True)[:3] == [(0, 0, 0, 2, 0), (0, 0, 0, 1, 1), (0, 0, 0, 0, 1)]
    edges = bound.age_edges(2, 4.0)
    for table in bound.density_tables(bound.next_uses(ids), bound.classes_of(ids, offsets, False), edges).values():
        assert table.shape == (bound.BINS,) and np.all(np.isfinite(table)) and np.all(table >= 0)


def test_rows_lie_between_belady_and_a_full_miss(bound) -> None:
    for row in bound.bound_rows(str(HEAD), [200, 800], 4.0):
        assert row["belady_miss"] < row["lru_miss"]
        for name in ("coarse", "rich"):
            assert row["belady_miss"] - 1e-12 <= row[f"{name}_miss"] <= 1.0


def test_first_half_fit_scores_the_second_half(bound) -> None:
    ids, offsets = bound.requests_of(str(HEAD))
    half = len(ids) // 2
    for row in bound.bound_rows(str(HEAD), [200], 4.0, fit="first-half"):
        assert row["fit"] == "first-half"
        assert row["lru_miss"] == pytest.approx(1 - bound.lru_hits(ids, offsets, 200)[half:].mean(), abs=1e-12)
        for name in ("coarse", "rich"):
            assert 0.0 <= row[f"{name}_miss"] <= 1.0
