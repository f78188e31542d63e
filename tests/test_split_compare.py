"""``compare --split`` (tune on the first half, report on the second) and ``report --across``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiercache.cli import main
from tiercache.results import read_results
from tiercache.sim.loader import load_trace
from tiercache.sim.split import split_halves
from tiercache.sim.sweep import run_sweep

DATA = Path(__file__).parent / "data"
TRACE = str(DATA / "mooncake_head.jsonl")


def test_halves_partition_the_trace() -> None:
    trace = load_trace(TRACE)
    first, second = split_halves(trace)
    assert first.records + second.records == trace.records == 300
    assert np.array_equal(np.concatenate([first.ids, second.ids]), trace.ids)
    assert second.offsets[0] == 0 and second.offsets[-1] == len(second.ids)
    assert np.array_equal(second.input_lengths, trace.input_lengths[150:])
    assert len({trace.fingerprint, first.fingerprint, second.fingerprint}) == 3


def test_split_names_the_first_half_winner_and_measures_it_on_the_second(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rep"
    argv = ["compare", str(DATA / "kvtester_sample"), "--policy", "session,fifo", "--capacity", "300,900",
            "--semantics", "prefix", "--split", "--workers", "1", "--no-progress", "-o", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    tune, test = read_results(out / "results_first_half.json"), read_results(out / "results.json")
    assert tune.trace.name.endswith("#first-half") and test.trace.name.endswith("#second-half")
    assert {r.policy for r in test.runs} == {"lru", "session", "fifo", "belady"}
    miss = {(r.policy, r.capacity_blocks): r.miss_ratio for r in test.runs}
    tuned = {(r.policy, r.capacity_blocks): r.miss_ratio for r in tune.runs}
    for cap in (300, 900):
        winner = min(("lru", "session", "fifo"), key=lambda p: (tuned[(p, cap)], p != "lru"))
        gap = (miss[("lru", cap)] - miss[(winner, cap)]) / (miss[("lru", cap)] - miss[("belady", cap)])
        assert f"| {winner} | {miss[(winner, cap)]:.6f} | {100 * gap:.1f}% |" in printed
    assert (out / "split.md").read_text().count("#second-half") == 2


def test_report_across_names_the_best_policy_per_trace(tmp_path: Path, capsys) -> None:
    paths = []
    for name, trace in (("a.json", TRACE), ("b.json", str(DATA / "kvtester_sample"))):
        doc = run_sweep(trace, ["lru", "session", "belady"], [400], ["prefix"])
        (tmp_path / name).write_text(json.dumps(doc))
        paths.append(str(tmp_path / name))
    assert main(["report", "--across", *paths, "-o", str(tmp_path / "gaps")]) == 0
    table = (tmp_path / "gaps" / "gaps.md").read_text()
    assert "mooncake_head.jsonl" in table and "kvtester_sample" in table
    assert table == "# Gap closed per trace and capacity\n\n" + capsys.readouterr().out


def test_split_refuses_a_trace_of_one_request(tmp_path: Path, capsys) -> None:
    path = tmp_path / "one.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n')
    code = main(["compare", str(path), "--policy", "session", "--capacity", "4", "--split", "--no-progress",
                 "-o", str(tmp_path / "r")])
    assert code == 2 and "a split needs at least two" in capsys.readouterr().err


def test_split_refuses_a_half_without_block_accesses(tmp_path: Path, capsys) -> None:
    """A half of empty requests would report a miss ratio of 0 (nothing to miss): refused."""
    lines = [{"timestamp": t, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}
             for t, ids in enumerate([[1, 2], [1, 3], [], []])]
    path = tmp_path / "empty_half.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code = main(["compare", str(path), "--policy", "lru,arc", "--capacity", "2", "--split", "--no-progress",
                 "-o", str(tmp_path / "r")])
    assert code == 2 and "the second half (requests 3-4) has no block access" in capsys.readouterr().err
