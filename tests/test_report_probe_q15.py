"""Probe q15: trace names a report cannot take as they are, and what a split report leads with."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tiercache.cli import main
from tiercache.results import read_results
from tiercache.sim.loader import load_trace
from tiercache.sim.split import split_halves

DATA = Path(__file__).parent / "data"
HEAD = DATA / "mooncake_head.jsonl"
KVTESTER = DATA / "kvtester_sample"
QUIET = ["--workers", "1", "--no-progress"]


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_file_names_not_utf8_or_holding_a_line_break_replay_report_and_compare(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "kv"
    folder.mkdir()
    shutil.copy(KVTESTER / sorted(os.listdir(KVTESTER))[0], folder / os.fsdecode(b"\xffconv.json"))
    assert main(["replay", str(folder), "--capacity", "50", *QUIET]) == 0
    assert main(["trace", "inspect", str(folder)]) == 0
    for raw, shown in ((b"\xffhead.jsonl", "\\xffhead.jsonl"), (b"new\nline.jsonl", "new\\nline.jsonl")):
        trace = tmp_path / os.fsdecode(raw)
        shutil.copy(HEAD, trace)
        results, out = str(tmp_path / "r.json"), tmp_path / "out"
        assert main(["replay", str(trace), "--policy", "lru,arc,belady", "--capacity", "200", "--out", results, *QUIET]) == 0
        assert main(["report", results, "-o", str(out / "rep")]) == 0
        assert _lines(out / "rep" / "report.md")[0] == f"# Cache policy comparison: {shown}"
        html = (out / "rep" / "index.html").read_text(encoding="utf-8")  # a line break is white space there
        assert f"Cache policy comparison: {shown if raw[0] == 0xFF else trace.name}</h1>" in html
        assert main(["report", "--across", results, "-o", str(out / "gaps")]) == 0
        assert any(line.startswith(f"| {shown} | object | single | 200 |") for line in _lines(out / "gaps" / "gaps.md"))
        assert main(["compare", str(trace), "--policy", "arc", "--capacity", "200", "--split", "-o", str(out / "cmp"),
                     *QUIET]) == 0
        assert sum(line.startswith(f"| {shown}#second-half | object |") for line in _lines(out / "cmp" / "split.md")) == 1
        shutil.rmtree(out)
    capsys.readouterr()


def test_a_split_report_leads_with_the_policy_tuned_on_the_first_half(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rep"
    assert main(["compare", str(KVTESTER), "--policy", "arc,s3fifo,fifo", "--capacity", "300,900", "--split",
                 "-o", str(out), *QUIET]) == 0
    capsys.readouterr()
    rows = [line.split(" | ") for line in _lines(out / "split.md") if line.startswith("| kvtester_sample")]
    tuned = {int(r[3].replace(",", "")): (r[7], r[9], r[10], r[11]) for r in rows}  # tuned, its gap, hindsight, its gap
    assert tuned[900][0] != tuned[900][2]  # the case the split exists for: hindsight picks another policy
    report = (out / "report.md").read_text(encoding="utf-8")
    findings = report.split("Key findings:")[1].split("\n\n")[1].splitlines()
    for capacity, line in zip((300, 900), findings):
        policy, gap, best, best_gap = tuned[capacity]
        assert line.startswith(f"- At {capacity} blocks (object semantics, one tier), {policy}, the policy tuned on the "
                               "first half, misses"), line
        assert f"closing {gap} of the lru–belady gap" in line
        assert "in hindsight" in line and (best == policy or f"{best} did best" in line), line
        assert line.index(gap) < line.index("in hindsight") and line.count("closing") == (1 if best == policy else 2)
    table = report.split("The policy tuned on the first half in each cache (each capacity")[1]
    assert "| tuned on 1st half | its miss ratio | lru miss ratio | belady miss ratio | gap closed | best in hindsight " \
           "| hindsight miss ratio | hindsight gap closed |" in table
    assert f"| object | single | 900 | {tuned[900][0]} |" in table
    html = (out / "index.html").read_text(encoding="utf-8")
    assert "the policy tuned on the first half" in html and "best in hindsight" in html


def test_a_folder_given_as_dir_slash_or_dir_dot_is_named_by_the_folder(tmp_path: Path, capsys) -> None:
    for spelling in (f"{KVTESTER}/", f"{KVTESTER}/.", f"{KVTESTER}//./"):
        trace = load_trace(spelling)
        assert trace.info().name == "kvtester_sample"
        assert [h.info().name for h in split_halves(trace)] == ["kvtester_sample#first-half", "kvtester_sample#second-half"]
    results = tmp_path / "r.json"
    assert main(["replay", f"{KVTESTER}/", "--capacity", "500", "--out", str(results), *QUIET]) == 0
    assert capsys.readouterr().out.startswith("kvtester_sample: ")
    assert read_results(results).trace.name == "kvtester_sample"


def test_a_split_report_draws_the_dense_lru_curve_of_its_half(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rep"
    assert main(["compare", str(HEAD), "--policy", "arc", "--capacity", "100,400", "--split", "-o", str(out), *QUIET]) == 0
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "The wide pale line is LRU at" in report and "It matches the replayed LRU misses exactly" in report
    assert "left out" not in report
    again = tmp_path / "again"
    assert main(["report", str(out / "results.json"), "-o", str(again)]) == 0
    capsys.readouterr()
    note = next(line for line in _lines(again / "report.md") if "one-pass LRU curve is left out" in line)
    assert "give --trace" not in note and "second half" in note and "compare --split" in note
    assert main(["report", str(out / "results.json"), "--trace", str(HEAD), "-o", str(again)]) == 2
    assert "no file holds, so no --trace can match them" in capsys.readouterr().err
