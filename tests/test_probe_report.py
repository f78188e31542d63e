"""``tiercache report`` on results files it must refuse or read (probe findings 8, 9, 20, 25).

Every refusal is exit status 2 with one line naming the file and the run, never a
traceback; results files written by the current ``tiercache replay`` (request traces, a
hierarchy, prefix semantics, a kv-cache-tester folder) still read and report.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from conftest import DATA
from tiercache.cli import main

MOONCAKE = DATA / "mooncake_head.jsonl"
KVTESTER = DATA / "kvtester_sample"


def _replay(trace: Path, out: Path, *options: str) -> dict:
    argv = ["replay", str(trace), "--policy", "lru,belady", "--workers", "1", "--no-progress", "--out", str(out), *options]
    assert main(argv) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    """A results file of two single-tier runs, as ``tiercache replay`` writes it now."""
    return _replay(MOONCAKE, tmp_path_factory.mktemp("base") / "base.json", "--capacity", "100,400")


def _report(capsys, *argv: str) -> tuple[int, str]:
    code = main(["report", *argv])
    return code, capsys.readouterr().err


def _set(path: str, value):
    """A change that sets the value at ``path`` (keys and list indices, dot-separated)."""
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]

    def change(data: dict) -> None:
        for key in parents:
            data = data[key]
        data[last] = value

    return change


@pytest.mark.parametrize("change, needle", [
    (_set("runs.0.tiers.0.name", "ssd"), "run 1: tier 1: field 'name' must be one of hbm, dram, nvme, remote, got 'ssd'"),
    (_set("runs.0.miss_ratio", float("nan")), "run 1: field 'miss_ratio' must be a finite number, got nan"),
    (_set("runs.0.miss_ratio", float("inf")), "run 1: field 'miss_ratio' must be a finite number, got inf"),
    (_set("runs.0.miss_ratio", 1.5), "run 1: field 'miss_ratio' must be a number in [0, 1], got 1.5"),
    (_set("runs.1.miss_ratio", 0.5), "run 2: inconsistent counts: miss_ratio 0.5 is not"),
    (_set("runs.0.hit_ratio", 0.0), "run 1: inconsistent counts: hit_ratio 0.0 is not 28 / 7721"),
    (_set("runs.0.wall_seconds", 10**400), "run 1: field 'wall_seconds' must be a finite number"),
    (_set("runs.0.tiers", []), "run 1: field 'tiers' must be a non-empty list of tier objects, got []"),
    (_set("runs.0.placement", "nope"), "run 1: field 'placement' must be one of top, reuse (or module:Class), got 'nope'"),
    (_set("runs.1.semantics", "decode"), "run 2: semantics 'decode' is how step traces replay, but the trace is a request"),
    (_set("runs.0.capacity_blocks", 0), "run 1: field 'capacity_blocks' must be an integer in [1, 2**63), got 0"),
    (_set("runs.0.capacity_blocks", 2**70),
     "run 1: field 'capacity_blocks' must be an integer in [1, 2**63), got 1180591620717411303424"),
    (_set("runs.0.tiers.0.capacity_blocks", 0), "run 1: tier 1: field 'capacity_blocks' must be an integer in [1, 2**63)"),
    (_set("runs.0.tiers.0.evictions", 2**63), "run 1: tier 1: field 'evictions' must be an integer in [0, 2**63)"),
    (_set("runs.0.bytes_moved", {"hbm->dram": 2**64}), "run 1: field 'bytes_moved' must be an integer in [0, 2**63)"),
    (_set("trace.unique_blocks", 10**6), "trace: inconsistent counts: unique_blocks 1000000 > accesses 7721"),
], ids=["tier-name", "nan", "inf", "ratio-over-1", "ratio-contradicts", "hit-ratio-contradicts", "huge-seconds",
        "no-tiers", "placement", "decode-on-requests", "capacity-0", "capacity-2**70", "tier-capacity-0", "count-2**63",
        "bytes-2**64", "unique-over-accesses"])
def test_report_refuses_values_no_replay_writes(tmp_path, capsys, base, change, needle):
    data = copy.deepcopy(base)
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    code, err = _report(capsys, str(path), "-o", str(tmp_path / "out"))
    assert code == 2 and f"{path}: {needle}" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_report_refuses_tiers_out_of_order(tmp_path, capsys):
    data = _replay(MOONCAKE, tmp_path / "tiers.json", "--tiers", "hbm=50,dram=100")
    data["runs"][0]["tiers"].reverse()
    (tmp_path / "tiers.json").write_text(json.dumps(data))
    code, err = _report(capsys, str(tmp_path / "tiers.json"), "-o", str(tmp_path / "out"))
    assert code == 2 and "run 1: tiers must be distinct and fastest first (hbm, dram, nvme, remote), got dram, hbm" in err


def test_report_refuses_an_integer_too_long_to_read(tmp_path, capsys, base):
    text = json.dumps(base).replace('"hits": 28,', '"hits": ' + "9" * 5000 + ",", 1)
    (tmp_path / "long.json").write_text(text)
    code, err = _report(capsys, str(tmp_path / "long.json"), "-o", str(tmp_path / "out"))
    assert code == 2 and "long.json: not a results file (a number of more than" in err and "Traceback" not in err


def test_current_replay_files_still_read(tmp_path, capsys):
    """A hierarchy with prefix semantics and placement reuse, as replay writes it: read and reported."""
    path = tmp_path / "tiered.json"
    _replay(MOONCAKE, path, "--tiers", "hbm=50,dram=100,nvme=200", "--semantics", "both", "--placement", "reuse",
            "--model", "llama-3-8b", "--hardware", "h200-pcie5-nvme4")
    code, err = _report(capsys, str(path), "-o", str(tmp_path / "out"))
    assert code == 0, err
    header = (tmp_path / "out" / "results.csv").read_text().splitlines()[0]
    assert "nvme_hits" in header and "reuse" in (tmp_path / "out" / "results.csv").read_text()


def test_truncated_results_file_names_line_and_column(tmp_path, capsys, base):
    text = json.dumps(base, indent=1)
    (tmp_path / "trunc.json").write_text(text[: text.index('"policy": "belady"') + 5])
    code, err = _report(capsys, str(tmp_path / "trunc.json"), "-o", str(tmp_path / "out"))
    assert code == 2 and "not a JSON results file (Unterminated string starting at: line " in err and "at at" not in err


def test_the_same_results_file_twice_is_refused(tmp_path, capsys, base, monkeypatch):
    """(``report --across`` reads it once, with a note: tests/test_report_across_duplicates.py.)"""
    (tmp_path / "a.json").write_text(json.dumps(base))
    monkeypatch.chdir(tmp_path)
    code, err = _report(capsys, "a.json", "./a.json", "-o", "out")
    assert code == 2 and "./a.json: results file given twice (as 'a.json' and './a.json')" in err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def kv_results(tmp_path_factory) -> Path:
    """Results of the kv-cache-tester sample folder, as ``tiercache replay`` writes them."""
    path = tmp_path_factory.mktemp("kv") / "kv.json"
    _replay(KVTESTER, path, "--capacity", "100,400")
    return path


def test_report_draws_the_lru_curve_from_the_recorded_kvtester_folder(tmp_path, capsys, kv_results):
    code, err = _report(capsys, str(kv_results), "-o", str(tmp_path / "out"))
    assert code == 0, err
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "was not found" not in markdown and "It matches the replayed LRU misses exactly" in markdown


def test_report_trace_option_takes_a_kvtester_folder(tmp_path, capsys, kv_results):
    moved = tmp_path / "moved"
    shutil.copytree(KVTESTER, moved)
    code, err = _report(capsys, str(kv_results), "--trace", str(moved), "-o", str(tmp_path / "out"))
    assert code == 0, err
    assert "It matches the replayed LRU misses exactly" in (tmp_path / "out" / "report.md").read_text()
    next(moved.glob("*.json")).unlink()  # another workload: one conversation fewer
    code, err = _report(capsys, str(kv_results), "--trace", str(moved), "-o", str(tmp_path / "other"))
    assert code == 2 and f"--trace {moved}: not the trace of these results" in err
