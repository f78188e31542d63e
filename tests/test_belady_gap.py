"""``scripts/belady_gap.py``: its plain LRU and Belady agree with ``tiercache replay``, and the
accesses it calls Belady-only are exactly Belady's hits that LRU misses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiercache.sim.sweep import run_sweep

ROOT = Path(__file__).resolve().parent.parent
HEAD = ROOT / "tests" / "data" / "mooncake_head.jsonl"
CAPACITIES = [200, 800]


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("gap") / "rows.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "belady_gap.py"), str(HEAD), "--capacity",
                    ",".join(map(str, CAPACITIES)), "--json", str(out)], check=True, capture_output=True, timeout=120)
    return json.loads(out.read_text())


def test_miss_ratios_are_the_replays(rows: list[dict]) -> None:
    doc = run_sweep(str(HEAD), ["lru", "belady"], CAPACITIES, ["prefix"])
    replayed = {(r["policy"], r["capacity_blocks"]): r["miss_ratio"] for r in doc["runs"]}
    for row in rows:
        assert row["lru_miss"] == pytest.approx(replayed[("lru", row["capacity"])], abs=1e-12)
        assert row["belady_miss"] == pytest.approx(replayed[("belady", row["capacity"])], abs=1e-12)
        assert row["belady_miss"] < row["lru_miss"]


def test_belady_hits_split_into_shared_and_belady_only(rows: list[dict]) -> None:
    for row in rows:
        both = row["belady_hits_lru_also"] * (1 - row["belady_miss"])
        # Belady's hits = hits both get + hits only Belady gets; LRU's hits >= the shared ones.
        assert both + row["belady_only_share"] == pytest.approx(1 - row["belady_miss"], abs=1e-9)
        assert both <= 1 - row["lru_miss"] + 1e-9
        assert 0.0 <= row["beyond_2_capacities"] <= 1.0
        if row["belady_only_share"] > 0:
            q10, q50, q90 = row["gap_capacities_q10_50_90"]
            assert 0 < q10 <= q50 <= q90
            assert row["prior_uses_q10_50_90"][0] >= 1  # a hit needs an earlier use


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("belady_gap", ROOT / "scripts" / "belady_gap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_frequency_oracle_holds_the_most_used_blocks_and_needs_a_first_use() -> None:
    gap = _script()
    requests = [[1, 2], [3], [1, 2], [3], [1, 2], [4, 1]]
    ids = [b for r in requests for b in r]
    offsets = [0]
    for r in requests:
        offsets.append(offsets[-1] + len(r))
    hit = gap.frequency_oracle_hits(ids, offsets, 2)  # counts: 1 -> 4, 2 -> 3, 3 -> 2, 4 -> 1: keeps {1, 2}
    assert hit.tolist() == [False, False, False, True, True, False, True, True, False, False]
    # the request (4, 1) misses 1 too: its first block is not kept, so nothing after it hits
    assert gap.frequency_oracle_hits(ids, offsets, 3)[5]  # with room for 3 it is kept, and seen at access 2


def test_frequency_oracle_column(rows: list[dict]) -> None:
    for row in rows:
        assert 0.0 < row["frequency_oracle_miss"] <= 1.0


def test_dead_first_oracle_evicts_dead_blocks_before_live_ones() -> None:
    gap = _script()
    requests = [[1], [2], [3], [1], [3]]  # 2 is never used again: with room for 2, 1 survives 3's insert
    ids = [b for r in requests for b in r]
    offsets = list(range(len(ids) + 1))
    upcoming = gap.next_uses(ids)
    assert gap.dead_first_hits(ids, offsets, 2, upcoming).tolist() == [False, False, False, True, True]
    assert gap.lru_hits(ids, offsets, 2).tolist() == [False, False, False, False, True]  # LRU drops 1 for 3


def test_one_use_first_oracle_knows_one_off_blocks_but_not_last_uses() -> None:
    gap = _script()
    ids = [1, 2, 3, 1]  # 2 and 3 are used once: with room for 2, 1 survives 3's insert
    offsets = list(range(len(ids) + 1))
    assert gap.one_use_first_hits(ids, offsets, 2).tolist() == [False, False, False, True]
    assert gap.lru_hits(ids, offsets, 2).tolist() == [False, False, False, False]
    ids = [1, 2, 1, 3, 2]  # 1's second use is its last: dead-first drops it for 3, one-use-first cannot tell
    offsets = list(range(len(ids) + 1))
    assert gap.dead_first_hits(ids, offsets, 2, gap.next_uses(ids)).tolist() == [False, False, True, False, True]
    assert gap.one_use_first_hits(ids, offsets, 2).tolist() == [False, False, True, False, False]


def test_class_accuracy_is_at_least_the_constant_answer(rows: list[dict]) -> None:
    gap = _script()
    ids = [1, 2, 1, 2, 1, 2]
    offsets = [0, 2, 4, 6]
    upcoming = gap.next_uses(ids)
    belady = gap.belady_hits(ids, offsets, 2, upcoming)
    by_class, constant = gap.class_accuracy(ids, offsets, belady, upcoming)
    # everything is kept; the last two accesses (no next use) are "not kept": classes (2, 2) split them off
    assert (by_class, constant) == (1.0, 4 / 6)
    for row in rows:
        assert row["constant_accuracy"] <= row["class_accuracy"] <= 1.0
        assert row["belady_miss"] <= row["dead_first_miss"] <= 1.0
        assert row["belady_miss"] <= row["one_use_first_miss"] <= 1.0
