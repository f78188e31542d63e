"""``tiercache report --across`` counts each run of each trace once.

A trace is its fingerprint, not its file name: results files of one trace (a copy, the same
file named twice, a replay saved twice, sweeps that overlap) merge into one trace's runs, each
run once, with a note on stderr naming the file each duplicate repeats; one run of one trace
with different counts in two files is refused (it would give the trace two rows); different
traces that share a name are told apart by fingerprint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import DATA
from test_report import make_document, make_run, write_json
from tiercache.cli import main

FP_A = "xxh3-128:" + "a" * 32
FP_B = "xxh3-128:" + "b" * 32


def _across(capsys, out: Path, *paths) -> tuple[int, str, str]:
    """Runs ``report --across``; returns its status, the table printed and stderr."""
    code = main(["report", "--across", *map(str, paths), "-o", str(out)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _document(fingerprint: str = FP_A, policies=("lru", "fifo", "belady"), capacities=(100, 400), **changes) -> dict:
    """A results document of ``policies`` × ``capacities`` (LRU misses most, Belady least)."""
    miss = {"lru": 0.9, "fifo": 0.85, "s3fifo": 0.8, "belady": 0.6}
    runs = [make_run(p, c, miss[p] - i / 20) for i, c in enumerate(capacities) for p in policies]
    return make_document(fingerprint, runs) | changes


def _rows(table: str) -> list[str]:
    return [line for line in table.splitlines()[2:] if line.startswith("|")]


def test_a_copied_replay_results_file_counts_once(tmp_path, capsys):
    """The defect as met: ``replay --out a.json``, copied to b.json, gave every row twice."""
    argv = ["replay", str(DATA / "mooncake_head.jsonl"), "--policy", "lru,arc,belady", "--capacity", "100,400",
            "--workers", "1", "--no-progress", "--out", str(tmp_path / "a.json")]
    assert main(argv) == 0
    shutil.copy(tmp_path / "a.json", tmp_path / "b.json")
    capsys.readouterr()
    code, alone, _ = _across(capsys, tmp_path / "one", tmp_path / "a.json")
    assert code == 0 and len(_rows(alone)) == 2
    code, both, err = _across(capsys, tmp_path / "two", tmp_path / "a.json", tmp_path / "b.json")
    assert code == 0 and both == alone
    assert (tmp_path / "two" / "gaps.md").read_text().endswith(alone)
    assert f"note: {tmp_path / 'b.json'} duplicates {tmp_path / 'a.json'} (trace 'mooncake_head.jsonl': " \
           "the same 6 runs): counted once" in err


def test_the_same_file_named_twice_is_read_once(tmp_path, capsys, monkeypatch):
    write_json(tmp_path / "a.json", _document())
    monkeypatch.chdir(tmp_path)
    code, alone, _ = _across(capsys, tmp_path / "one", "a.json")
    code, twice, err = _across(capsys, tmp_path / "two", "a.json", "./a.json", "a.json")
    assert code == 0 and twice == alone
    assert err.splitlines() == ["tiercache report: note: ./a.json is a.json given again: read once",
                                "tiercache report: note: a.json is a.json given again: read once"]


def test_a_replay_saved_twice_counts_once(tmp_path, capsys):
    """Another wall time and command line, the same figures: the same runs."""
    first = write_json(tmp_path / "first.json", _document())
    again = _document(command="tiercache replay trace.jsonl --out again.json")
    for run in again["runs"]:
        run["wall_seconds"] = 9.5
    second = write_json(tmp_path / "second.json", again)
    code, alone, _ = _across(capsys, tmp_path / "one", first)
    code, both, err = _across(capsys, tmp_path / "two", first, second)
    assert code == 0 and both == alone
    assert f"{second} duplicates {first} (trace 'my_trace.jsonl': the same 6 runs): counted once" in err


def test_overlapping_sweeps_of_one_trace_merge_into_one_row_per_cache(tmp_path, capsys):
    small = write_json(tmp_path / "small.json", _document(capacities=(100,)))
    wide = write_json(tmp_path / "wide.json", _document(policies=("lru", "fifo", "s3fifo", "belady")))
    code, table, err = _across(capsys, tmp_path / "gaps", small, wide)
    assert code == 0
    rows = _rows(table)
    assert len(rows) == 2 and all("| s3fifo |" in row for row in rows)  # the best over both files' policies
    assert f"{wide}: 3 of its 8 runs repeat {small} (trace 'my_trace.jsonl', same counts): counted once" in err


def test_one_run_with_other_counts_in_two_files_is_refused(tmp_path, capsys):
    good = write_json(tmp_path / "good.json", _document())
    stale = _document()
    stale["runs"][1] = make_run("fifo", 100, 0.87)
    stale = write_json(tmp_path / "stale.json", stale)
    code, out, err = _across(capsys, tmp_path / "gaps", good, stale)
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"error: {stale} and {good} both hold fifo at 100 blocks (object, single) with different counts" in err
    assert not (tmp_path / "gaps").exists()


def test_same_counts_under_another_layout_count_once_and_say_what_differs(tmp_path, capsys):
    modeled = write_json(tmp_path / "modeled.json", _document())
    plain = write_json(tmp_path / "plain.json", _document(layout=None, hardware=None) | {
        "runs": [run | {"modeled_seconds": {}} for run in _document()["runs"]]})
    code, alone, _ = _across(capsys, tmp_path / "one", modeled)
    code, both, err = _across(capsys, tmp_path / "two", modeled, plain)
    assert code == 0 and both == alone
    assert f"{plain}: 6 of its 6 runs repeat {modeled} (trace 'my_trace.jsonl', same counts): counted once; " \
           "6 of them record other bytes, modeled seconds or tier counters" in err


def test_one_trace_under_two_names_is_one_trace(tmp_path, capsys):
    first = write_json(tmp_path / "first.json", _document())
    renamed = _document()
    renamed["trace"] = renamed["trace"] | {"name": "copy.jsonl"}
    renamed = write_json(tmp_path / "renamed.json", renamed)
    code, table, err = _across(capsys, tmp_path / "gaps", first, renamed)
    assert code == 0 and len(_rows(table)) == 2 and "copy.jsonl" not in table
    assert f"{renamed} names its trace 'copy.jsonl', the same trace (fingerprint {FP_A}) as {first}'s " \
           "'my_trace.jsonl': its rows are labelled 'my_trace.jsonl'" in err


def test_different_traces_of_one_name_are_told_apart_by_fingerprint(tmp_path, capsys):
    a = write_json(tmp_path / "a.json", _document(FP_A))
    b = write_json(tmp_path / "b.json", _document(FP_B))
    legacy = write_json(tmp_path / "legacy.json", _document("c" * 32))
    code, table, err = _across(capsys, tmp_path / "gaps", a, b, legacy)
    assert code == 0
    labels = [row.split(" | ")[0] for row in _rows(table)]
    assert labels == ["| my_trace.jsonl (xxh3-128:aaaaaaaaaaaa)"] * 2 + ["| my_trace.jsonl (xxh3-128:bbbbbbbbbbbb)"] * 2 \
        + ["| my_trace.jsonl (blake2b:cccccccccccc)"] * 2
    assert f"{a}, {b}, {legacy} hold different traces (fingerprints) named 'my_trace.jsonl'" in err
    assert "written before trace fingerprints became xxh3-128, so one trace may be listed twice" in err


def test_runs_repeated_within_one_file_count_once(tmp_path, capsys):
    """``replay --policy lru,lru`` writes one run twice: one row, and a note saying so."""
    data = _document(capacities=(100,))
    data["runs"].append(json.loads(json.dumps(data["runs"][0])))
    path = write_json(tmp_path / "twice.json", data)
    code, table, err = _across(capsys, tmp_path / "gaps", path)
    assert code == 0 and len(_rows(table)) == 1
    assert f"{path}: 1 of its 4 runs repeat runs before them in the same file" in err
