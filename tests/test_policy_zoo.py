"""scripts/policy_zoo.py: both sides replay the same trace, the common ground is checked count
for count, and every gap closed is computed from the miss counts it prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_mrc import lru_misses
from test_script_bench_honesty import _script

pytest.importorskip("libcachesim")

HEAD = str(Path(__file__).parent / "data" / "mooncake_head.jsonl")
CAPACITIES = [50, 400]
BEYOND = 1_000_000  # more than the trace's blocks: LRU misses no more than Belady


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo") / "zoo.json"
    code = _script("policy_zoo").main(["--trace", HEAD, "--capacity", ",".join(map(str, [*CAPACITIES, BEYOND])),
                                      "--workers", "1", "--json", str(out)])
    return code, json.loads(out.read_text(), parse_constant=_refuse)


def _refuse(name: str):
    raise AssertionError(f"{name} in the JSON: not strict JSON")


def test_zoo_agrees_on_common_ground_and_exits_0(zoo):
    code, result = zoo
    assert code == 0 and result["problems"] == []
    rows = result["rows"]
    for capacity in CAPACITIES:
        group = [r for r in rows if r["capacity"] == capacity]
        assert {r["side"] for r in group} == {"tiercache", "libCacheSim"}
        assert len({(r["side"], r["policy"]) for r in group}) == len(group)
        assert [r["miss_ratio"] for r in group] == sorted(r["miss_ratio"] for r in group)
        ours = {r["policy"]: r for r in group if r["side"] == "tiercache"}
        theirs = {r["policy"]: r for r in group if r["side"] == "libCacheSim"}
        assert "belady" not in ours and "Belady" not in theirs  # offline: the bound, not a competitor
        assert ours["lru"]["gap_closed"] == 0.0
        for mine, other in (("fifo", "FIFO"), ("sieve", "Sieve"), ("s3fifo", "S3FIFO")):
            assert ours[mine]["miss_ratio"] == theirs[other]["miss_ratio"], (capacity, mine)


def test_zoo_gap_is_computed_from_its_own_misses(zoo):
    from tiercache.sim.loader import load_trace

    ids = load_trace(HEAD).ids
    for row in zoo[1]["rows"]:
        if row["capacity"] == BEYOND:
            assert row["lru"] == row["belady"] and row["gap_closed"] is None
            continue
        assert row["lru"] == lru_misses(ids, row["capacity"]) / len(ids)
        assert row["belady"] < row["lru"]
        assert row["gap_closed"] == pytest.approx((row["lru"] - row["miss_ratio"]) / (row["lru"] - row["belady"]))


def test_zoo_refuses_a_trace_without_capacities(capsys):
    with pytest.raises(SystemExit) as exc:
        _script("policy_zoo").main(["--trace", HEAD])
    assert exc.value.code == 2
    assert "one --capacity per --trace" in capsys.readouterr().err
