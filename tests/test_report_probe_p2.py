"""Probe P2 of the comparison and report tools: what each figure and file says is true.

F1: a run's ``wall_seconds`` (the report's "replay wall time") times the replay alone; numba
compiles or loads the kernels before the clock starts. F2: ``scripts/gap_closed.py`` writes
``null`` and prints ``n/a`` where LRU misses no more than Belady (strict JSON). F3: its bad
arguments end in one line before any replay. F4: the results reader refuses runs that
contradict themselves (capacity, mode, policy name, wall time), and still reads what every
writer makes. F5: ``report --across`` names a trace (or cache) it has no row for. F6: split.md
and the split report say each half replays from a cold cache; split.md's columns are named
apart. F7: gaps.md escapes Markdown in trace names as report.md does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import DATA
from test_report import make_document, make_run, write_json
from tiercache.cli import main
from tiercache.config import TierConfig
from tiercache.errors import UserError
from tiercache.report.markdown import escape_markdown
from tiercache.results import ResultsDocument, Semantics, read_results
from tiercache.sim import chain
from tiercache.sim.loader import load_trace
from tiercache.sim.replay import ReplayData, RunSpec, replay, use_kernels

ROOT = Path(__file__).resolve().parent.parent
HEAD = DATA / "mooncake_head.jsonl"


def _write_trace(path: Path, requests: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1,
                                        "hash_ids": ids}) + "\n" for i, ids in enumerate(requests)))
    return path


# ----------------------------------------------------------------------------- F1

def test_wall_seconds_leaves_the_kernel_compilation_out(monkeypatch) -> None:
    """The first call of a numba dispatcher compiles (or loads) it: a stand-in that takes 0.6 s
    on its first call, as compiling does, must not show in ``wall_seconds``; the call that pays
    it replays nothing and has the argument types of the replay's own calls (it compiles the
    very signature the replay runs, once), and the counts are the replay's."""
    spec = RunSpec("lru", Semantics.PREFIX, (TierConfig("hbm", 64),))
    if not use_kernels(spec):
        pytest.skip("numba is not installed: no kernels to compile")
    data = ReplayData.prepare(load_trace(str(HEAD)), None, None)
    expected = replay(spec, data)
    real, calls = chain.run_requests, []

    def first_call_compiles(*args):
        if not calls:
            time.sleep(0.6)
        calls.append((args[8], args[9], tuple(type(a).__name__ + str(getattr(a, "dtype", "")) for a in args[5:])))
        return real(*args)

    monkeypatch.setattr(chain, "run_requests", first_call_compiles)
    run = replay(spec, data)
    assert run.wall_seconds < 0.6, run.wall_seconds
    assert calls[0][:2] == (0, 0), calls[0]  # the compiling call replays no request
    assert len({signature for _, _, signature in calls}) == 1, calls
    assert (run.hits, run.misses, run.tiers) == (expected.hits, expected.misses, expected.tiers)


# ----------------------------------------------------------------------------- F2, F3

def _gap_closed(*argv: str) -> subprocess.CompletedProcess:
    """``python scripts/gap_closed.py ARGV`` as a user runs it (this interpreter and path)."""
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gap_closed.py"), *argv], capture_output=True,
                          text=True, timeout=300, env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})


def test_gap_closed_writes_null_and_prints_na_without_a_gap(tmp_path) -> None:
    """Every block used once: LRU == Belady, no gap to close."""
    trace = _write_trace(tmp_path / "unique.jsonl", [[5 * i + j for j in range(5)] for i in range(20)])
    out = tmp_path / "gc.json"
    done = _gap_closed("--trace", str(trace), "--capacity", "4,8", "--policy", "arc,fifo", "--workers", "1",
                       "--json", str(out))
    assert done.returncode == 0 and "nan" not in done.stdout.lower(), done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("unique.jsonl") and len(line.split()) == 7]
    assert len(rows) == 4 and all(row[-1] == "n/a" for row in rows), done.stdout

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    document = json.loads(out.read_text(), parse_constant=refuse)
    assert [row["gap_closed"] for row in document["gap_closed"]] == [None] * 4


@pytest.mark.parametrize("argv, message", [
    (["--trace", "T"], "give one --capacity per --trace"),
    (["--trace", "T", "--capacity", "4k"], "argument --capacity: expected a positive integer, got '4k'"),
    (["--trace", "T", "--capacity", "2,3", "--policy", "arc"], "give a middle capacity of at least 4 blocks"),
    (["--trace", "T", "--capacity", "20", "--trace", "T", "--policy", "arc"], "give one --capacity per --trace"),
    (["--trace", "T", "--capacity", "20", "--policy", "arc,nope"], "unknown eviction policy 'nope'"),
    (["--trace", "nowhere.jsonl", "--capacity", "20"], "--trace nowhere.jsonl: no such file or folder"),
    (["--trace", "T", "--capacity", "20", "--workers", "0"], "argument --workers"),
])
def test_gap_closed_refuses_bad_arguments_in_one_line(argv, message, tmp_path) -> None:
    trace = _write_trace(tmp_path / "t.jsonl", [[1, 2], [1, 3]])
    done = _gap_closed(*[str(trace) if word == "T" else word for word in argv])
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stdout == "", done.stderr
    assert last.startswith("gap_closed.py: error: ") and message in last, done.stderr


# ----------------------------------------------------------------------------- F4

def _tampered(change) -> dict:
    document = make_document()
    change(document["runs"][0])
    return document


@pytest.mark.parametrize("change, message", [
    (lambda r: r["tiers"][0].__setitem__("capacity_blocks", 999),
     "run 1: field 'capacity_blocks' is 100, but its tiers hold 999 blocks (hbm 999)"),
    (lambda r: r.__setitem__("policy", ""), "run 1: field 'policy' must be a non-empty string"),
    (lambda r: r.__setitem__("wall_seconds", -5.0), "run 1: field 'wall_seconds' must be a number >= 0"),
    (lambda r: r.__setitem__("mode", "exclusive"), "run 1: field 'mode' is 'exclusive', but the run has 1 tier(s) (hbm)"),
])
def test_reader_refuses_a_run_that_contradicts_itself(change, message, tmp_path, capsys) -> None:
    path = write_json(tmp_path / "bad.json", _tampered(change))
    with pytest.raises(UserError, match="bad.json: " + message.replace("(", r"\(").replace(")", r"\)")):
        read_results(path)
    assert main(["report", path, "-o", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_reader_refuses_a_hierarchy_marked_single(tmp_path) -> None:
    run = make_run("lru", 500, 0.5, tiers=[("hbm", 100, 3000), ("dram", 400, 2000)])
    run["mode"] = "single"
    with pytest.raises(UserError, match=r"run 1: field 'mode' is 'single', but the run has 2 tier\(s\) \(hbm, dram\)"):
        ResultsDocument.from_json(make_document(runs=[run]), "h.json")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    """Results files as each writer makes them: one tier, hierarchies (exclusive, write-through,
    placement reuse, a quantised tier), fleets (private tiers and remote, remote alone), decode."""
    folder = tmp_path_factory.mktemp("writers")
    steps = folder / "steps.jsonl"
    assert main(["trace", "synth", "sparse", "-o", str(steps), "--steps", "40", "--blocks", "32", "--layers", "2"]) == 0
    cases = {
        "single": [str(HEAD), "--policy", "lru,arc,belady", "--capacity", "50,200", "--semantics", "object,prefix"],
        "exclusive": [str(HEAD), "--policy", "lru,belady", "--tiers", "hbm=40,dram=120,nvme=400"],
        "write_through": [str(HEAD), "--policy", "lru", "--tiers", "hbm=40,dram=120", "--write-through"],
        "reuse": [str(HEAD), "--policy", "lru,sieve", "--tiers", "hbm=40,dram=120", "--placement", "reuse"],
        "codec": [str(HEAD), "--policy", "lru", "--tiers", "hbm=40,dram=120:int8", "--model", "llama-3-8b",
                  "--hardware", "h200-pcie5-nvme4"],
        "fleet": [str(HEAD), "--policy", "lru", "--instances", "3", "--tiers", "hbm=40,dram=120,remote=600"],
        "fleet_remote_only": [str(HEAD), "--policy", "lru", "--instances", "2", "--tiers", "hbm=40,remote=300"],
        "decode": [str(steps), "--policy", "lru,arc", "--tiers", "hbm=10,dram=30"],
        "decode_prefetch": [str(steps), "--policy", "lru", "--tiers", "hbm=10,dram=30", "--prefetch", "layer_ahead"],
    }
    paths = {}
    for name, argv in cases.items():
        paths[name] = folder / f"{name}.json"
        assert main(["replay", *argv, "--workers", "1", "--no-progress", "--out", str(paths[name])]) == 0, name
    return paths


def test_reader_reads_every_writers_files(written) -> None:
    """No file a replay, a fleet replay or a decode replay writes (nor a version-1 file) is refused."""
    for name, path in written.items():
        document = read_results(path)
        for run in document.runs:
            assert run.capacity_blocks == sum(t.capacity_blocks for t in run.tiers), name
            assert (run.mode.value == "single") == (len(run.tiers) == 1), name
            assert run.policy and run.wall_seconds >= 0, name
    assert any(run.is_fleet and len(run.tiers) == 2 for run in read_results(written["fleet_remote_only"]).runs)
    assert len(ResultsDocument.from_json(make_document(), "v1.json").runs) == 12


# ----------------------------------------------------------------------------- F5, F7

def test_across_names_a_trace_it_has_no_row_for(tmp_path, capsys) -> None:
    only_belady = make_document("a" * 32, [make_run("belady", c, 0.5) for c in (100, 400)])
    only_belady["trace"]["name"] = "offline_only.jsonl"
    mixed = make_document("b" * 32, [make_run(p, 100, m) for p, m in (("lru", 0.9), ("arc", 0.8), ("belady", 0.6))]
                          + [make_run("belady", 400, 0.4)])
    paths = [write_json(tmp_path / "offline.json", only_belady), write_json(tmp_path / "mixed.json", mixed)]
    assert main(["report", "--across", *paths, "-o", str(tmp_path / "gaps")]) == 0
    captured = capsys.readouterr()
    gaps = (tmp_path / "gaps" / "gaps.md").read_text()
    whole = (f"trace 'offline_only.jsonl' ({paths[0]}): no row: none of its 2 runs (belady) is a one-engine run of an "
             "online policy")
    cache = (f"trace 'my_trace.jsonl' ({paths[1]}): no row for 1 of its caches (object single HBM 400): they hold only "
             "offline runs (belady)")
    for sentence in (whole, cache):
        assert f"note: {sentence}" in captured.err
        assert f"- {escape_markdown(sentence, keep_intraword_underscores=True)}" in gaps
    assert gaps.endswith(captured.out) and "Not in this table:" in captured.out


def test_gaps_md_escapes_trace_names_as_report_md_does(tmp_path) -> None:
    name = "we|ird <b>x<\\b> _*name* `c` [l](http:evil).jsonl"
    document = make_document()
    document["trace"]["name"] = name
    path = write_json(tmp_path / "weird.json", document)
    assert main(["report", "--across", path, "-o", str(tmp_path / "gaps")]) == 0
    assert main(["report", path, "-o", str(tmp_path / "report")]) == 0
    rows = [line for line in (tmp_path / "gaps" / "gaps.md").read_text().splitlines() if line.startswith("| we")]
    escaped = r"we\|ird \<b>x\<\\b> \_\*name\* \`c\` \[l\](http:evil).jsonl"
    assert rows and all(row.startswith(f"| {escaped} | object | single |") for row in rows), rows
    assert f"# Cache policy comparison: {escaped}" in (tmp_path / "report" / "report.md").read_text()
    assert escape_markdown(name) == escaped  # the one function both use


def test_table_text_keeps_only_underscores_inside_words() -> None:
    """gaps.md and split.md are printed too: ``leaf_lru`` stays as typed (Markdown never reads an
    underscore between two letters as emphasis); every other special character is escaped."""
    from tiercache.report.across import escape_table_text

    assert escape_table_text("my_trace.jsonl leaf_lru a__b") == "my_trace.jsonl leaf_lru a__b"
    assert escape_table_text("_x_ a_*b*_ `c` <i> [l] |") == r"\_x\_ a\_\*b\*\_ \`c\` \<i> \[l\] \|"


# ----------------------------------------------------------------------------- F6

def test_split_outputs_say_each_half_starts_cold_and_name_columns_apart(tmp_path, capsys) -> None:
    out = tmp_path / "split"
    assert main(["compare", str(HEAD), "--policy", "fifo,arc", "--capacity", "20,80", "--split", "--workers", "1",
                 "--no-progress", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    cold = "Each half is replayed from a cold cache, as a trace of its own: the first half is requests 1-150, the " \
           "second requests 151-300, and nothing the first half stored carries over"
    split = (out / "split.md").read_text()
    assert cold in split and cold in printed and cold in (out / "report.md").read_text()
    assert cold in (out / "index.html").read_text()
    header = next(line for line in split.splitlines() if line.startswith("| trace"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert len(cells) == len(set(cells)) == 12
    assert cells[7:] == ["tuned on 1st half", "tuned miss", "tuned gap closed", "best in hindsight", "best gap closed"]
