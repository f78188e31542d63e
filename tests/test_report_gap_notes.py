"""A report says why a run has no gap closed when its cache holds no lru and belady runs at all
(it showed a bare "–"), ``results.csv`` names the two runs each gap closed was measured against
(``gap_references``), and a tie for the best online policy goes to a run that has a gap closed
(``arc+second_hit`` with no references of its own beat an equal ``arc+tinylfu`` by name)."""

from __future__ import annotations

import csv
from pathlib import Path

from tiercache.cli import main

HEAD = Path(__file__).parent / "data" / "mooncake_head.jsonl"
QUIET = ["--workers", "1", "--no-progress"]


def _replay(tmp_path: Path, name: str, *args: str) -> str:
    out = str(tmp_path / f"{name}.json")
    assert main(["replay", str(HEAD), "--semantics", "prefix", *args, "--out", out, *QUIET]) == 0
    return out


def _report(tmp_path: Path) -> Path:
    """Four files: plain references at HBM 50 + DRAM 100; arc alone at DRAM 200; tinylfu runs with
    their own references at DRAM 300, beside an arc+second_hit run with none."""
    files = [_replay(tmp_path, "a", "--policy", "lru,belady", "--tiers", "hbm=50,dram=100"),
             _replay(tmp_path, "b", "--policy", "arc", "--tiers", "hbm=50,dram=200"),
             _replay(tmp_path, "c", "--policy", "lru,belady,arc", "--admission", "tinylfu", "--tiers", "hbm=50,dram=300"),
             _replay(tmp_path, "d", "--policy", "arc", "--admission", "second_hit", "--tiers", "hbm=50,dram=300")]
    assert main(["report", *files, "-o", str(tmp_path / "rep")]) == 0
    return tmp_path / "rep"


def _rows(path: Path, start: str) -> list[list[str]]:
    return [line.split(" | ") for line in path.read_text(encoding="utf-8").splitlines() if line.startswith(start)]


def test_runs_without_any_references_are_named_with_what_to_replay_and_csv_names_each_gaps_references(
        tmp_path: Path, capsys) -> None:
    rep = _report(tmp_path)
    report = (rep / "report.md").read_text(encoding="utf-8")
    note = ("No gap closed for arc and arc+second\\_hit: these results hold no lru and belady runs of the same cache (the "
            "same capacity or tiers, semantics and mode), neither plain ones nor ones made with the same admission and "
            "placement; replay lru and belady over the same --capacity or --tiers for a gap.")
    assert note in report  # under the table of all runs
    assert "No gap closed for arc: these results hold no lru and belady runs" in report  # under the best-policy table
    with open(rep / "results.csv", encoding="utf-8", newline="") as handle:
        rows = {(row["policy"], row["admission"], row["hbm_capacity_blocks"], row["dram_capacity_blocks"]): row
                for row in csv.DictReader(handle)}
    expected = {("lru", "always", "50", "100"): "lru vs belady", ("belady", "always", "50", "100"): "lru vs belady",
                ("arc", "always", "50", "200"): "", ("arc", "tinylfu", "50", "300"): "lru+tinylfu vs belady+tinylfu",
                ("arc", "second_hit", "50", "300"): ""}
    for key, references in expected.items():
        assert rows[key]["gap_references"] == references, key
        assert (rows[key]["gap_closed"] == "") == (references == ""), key
    capsys.readouterr()


def test_a_tie_for_the_best_online_policy_goes_to_the_run_with_a_gap_closed(tmp_path: Path, capsys) -> None:
    rep = _report(tmp_path)
    (best,) = _rows(rep / "report.md", "| prefix | exclusive | 350 |")
    (tinylfu,) = _rows(rep / "report.md", "| arc+tinylfu | prefix | exclusive | 350 |")
    (second_hit,) = _rows(rep / "report.md", "| arc+second\\_hit | prefix | exclusive | 350 |")
    assert tinylfu[6:9] == second_hit[6:9]  # the two miss exactly as often here
    assert best[4] == "arc+tinylfu" and best[-1].rstrip(" |") == tinylfu[9] != "–"
    capsys.readouterr()
