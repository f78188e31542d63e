"""``tiercache compare`` end to end on the bundled trace head, against ``tiercache replay``."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tiercache.cli import main
from tiercache.report.writer import MARKER
from tiercache.sim.mrc import reuse_histogram
from tiercache.sim.sweep import run_sweep
from tiercache.sim.traces import flat_ids

TRACE = str(Path(__file__).parent / "data" / "mooncake_head.jsonl")
POLICIES = "lru,fifo,arc,belady"
CAPACITIES = "50,200,1k"


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> Path:
    """One compare run shared by the tests that only read its report."""
    out = tmp_path_factory.mktemp("compare") / "report"
    argv = ["compare", TRACE, "--policy", POLICIES, "--capacity", CAPACITIES, "--workers", "2", "--no-progress", "-o", str(out)]
    assert main(argv) == 0
    return out


def csv_rows(folder: Path) -> list[dict[str, str]]:
    with (folder / "results.csv").open(encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_compare_writes_the_report_folder(compared):
    names = {p.name for p in compared.iterdir()}
    assert {"index.html", "report.md", "results.csv", "results.json", MARKER} <= names
    assert "miss_ratio_object_single.png" in names
    assert len(csv_rows(compared)) == 4 * 3


def test_csv_numbers_equal_those_of_replay(compared, tmp_path):
    results = tmp_path / "replay.json"
    argv = ["replay", TRACE, "--policy", POLICIES, "--capacity", CAPACITIES, "--workers", "1", "--no-progress", "--out", str(results)]
    assert main(argv) == 0
    replayed = {(r["policy"], r["capacity_blocks"]): r for r in json.loads(results.read_text())["runs"]}
    rows = csv_rows(compared)
    assert len(rows) == len(replayed)
    for row in rows:
        run = replayed[(row["policy"], int(row["capacity_blocks"]))]
        assert (int(row["hits"]), int(row["misses"]), int(row["accesses"])) == (run["hits"], run["misses"], run["accesses"])
        assert float(row["miss_ratio"]) == run["miss_ratio"]


def test_report_states_dense_curve_matches_replays(compared):
    text = (compared / "report.md").read_text(encoding="utf-8")
    assert "matches the replayed LRU misses exactly at all 3 replayed capacities" in text
    command = json.loads((compared / "results.json").read_text())["command"]
    assert command.startswith("tiercache compare ") and f"--capacity {CAPACITIES}" in command and command in text


def test_one_pass_lru_equals_replayed_lru_at_every_capacity():
    capacities = [1, 2, 5, 17, 64, 300, 1000, 5000]
    results = run_sweep(TRACE, ["lru"], capacities, ["object"], workers=1, progress=False)
    replayed = [run["misses"] for run in results["runs"]]
    assert reuse_histogram(flat_ids(TRACE)).misses(capacities).tolist() == replayed


def test_reports_of_two_sweeps_merge(compared, tmp_path):
    other = tmp_path / "other"
    argv = ["compare", TRACE, "--policy", "lru,belady", "--capacity", "100", "--workers", "1", "--no-progress", "-o", str(other)]
    assert main(argv) == 0
    merged = tmp_path / "merged"
    assert main(["report", str(compared / "results.json"), str(other / "results.json"), "-o", str(merged)]) == 0
    assert len(csv_rows(merged)) == 4 * 3 + 2


def test_capacity_that_is_not_a_number(tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["compare", TRACE, "--capacity", "1k,lots", "--no-progress", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--capacity" in err and "lots" in err and "Traceback" not in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_output_folder_is_checked_before_the_sweep(tmp_path, capsys, monkeypatch):
    out = tmp_path / "src"
    out.mkdir()
    (out / "main.py").write_text("print('keep me')")
    monkeypatch.setattr("tiercache.cli.report.traced_sweep_from_args", lambda args: pytest.fail("the sweep ran"))
    assert main(["compare", TRACE, "--no-progress", "-o", str(out)]) == 2
    assert "not a tiercache report" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["main.py"]


def test_trace_option_must_match_the_results(compared, tmp_path, capsys):
    other_trace = tmp_path / "other.jsonl"
    other_trace.write_text(Path(TRACE).read_text().splitlines()[0] + "\n")
    argv = ["report", str(compared / "results.json"), "--trace", str(other_trace), "-o", str(tmp_path / "r")]
    assert main(argv) == 2
    assert "fingerprint" in capsys.readouterr().err


def test_one_capacity_and_a_trailing_slash_read_well(tmp_path):
    out = tmp_path / "r"
    argv = ["compare", TRACE, "--policy", "lru", "--capacity", "200", "--no-progress", "-o", f"{out}/"]
    assert main(argv) == 0
    text = (out / "report.md").read_text()
    assert "exactly at the one replayed capacity." in text
    assert f"results files: {out}/results.json." in text.replace("\\", "")
