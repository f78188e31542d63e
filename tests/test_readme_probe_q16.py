"""Probe q16: README.md read as a user's contract (what it promises the sweep's workers and the
analysis scripts do)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiercache.policies.kernels import HAVE_NUMBA

ROOT = Path(__file__).resolve().parent.parent
HEAD = ROOT / "tests" / "data" / "mooncake_head.jsonl"

# Run in a fresh interpreter (no kernel loaded yet): a sweep in two forked workers, noting how
# many compiled signatures the replay's dispatchers hold when the pool starts and when a worker
# begins a run. The on-disk cache is the default one (warm after any earlier test): nothing here
# forces a cold compile.
_SWEEP_IN_WORKERS = textwrap.dedent(f"""
    import multiprocessing
    from tiercache.sim import chain, sweep

    seen = multiprocessing.get_context("fork").RawArray("q", 3)
    real_pool, real_run = sweep.ProcessPoolExecutor, sweep._run_in_worker

    def pool(*args, **kwargs):
        seen[0] = len(chain.run_requests.signatures) * len(chain.init_all.signatures)
        return real_pool(*args, **kwargs)

    def run_in_worker(index, spec):
        seen[1 + index] = len(chain.run_requests.signatures) * len(chain.init_all.signatures)
        return real_run(index, spec)

    sweep.ProcessPoolExecutor, sweep._run_in_worker = pool, run_in_worker
    doc = sweep.run_sweep({str(HEAD)!r}, ["lru", "arc"], [100], ["prefix"], workers=2)
    assert len(doc["runs"]) == 2
    print(list(seen))
""")


@pytest.mark.skipif(not HAVE_NUMBA, reason="the replay kernels need numba")
def test_a_sweep_compiles_its_kernels_once_in_the_parent_and_no_worker_compiles_them() -> None:
    done = subprocess.run([sys.executable, "-c", _SWEEP_IN_WORKERS], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    at_pool, *at_runs = eval(done.stdout.strip().splitlines()[-1])
    assert at_pool >= 1, "the pool was forked before the parent compiled (or loaded) the replay kernels"
    assert all(n >= 1 for n in at_runs), f"a worker began a run with no compiled kernel: {at_runs}"


def _analysis(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


@pytest.mark.parametrize("script", ["belady_gap.py", "class_bound.py"])
def test_analysis_scripts_end_bad_input_in_one_line_before_any_work_and_say_na_without_a_gap(script, tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}\n'
                   '{"timestamp": 1, "input_length": \n')
    steps = tmp_path / "steps.jsonl"
    steps.write_text('{"block_tokens": 16}\n{"step": 0, "layer": 0, "read": [], "write": [0, 1, 2]}\n'
                     '{"step": 1, "layer": 0, "read": [0, 1, 2], "write": [3]}\n')
    cases = {  # arguments -> what the one line must say
        ("/nonexistent/trace.jsonl", "--capacity", "10"): "/nonexistent/trace.jsonl",
        (str(bad), "--capacity", "10"): "bad.jsonl:2: malformed JSON",
        (str(HEAD), "--capacity", "0"): "--capacity",
        (str(HEAD), "--capacity", "abc"): "--capacity",
        (str(HEAD), "--capacity", "10", "--json", "/nonexistent/rows.json"): "--json",
        (str(steps), "--capacity", "10"): "step trace",
    }
    for args, says in cases.items():
        done = _analysis(script, *args, cwd=tmp_path)
        lines = done.stderr.splitlines()
        assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{script}: error: "), (args, done.stderr)
        assert says in lines[0] and done.stdout == "", (args, done.stderr, done.stdout)
    if script == "class_bound.py":  # no eviction at all: LRU equals Belady, no gap to close
        done = _analysis(script, str(HEAD), "--capacity", "100000", "--json", str(tmp_path / "rows.json"), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "nan" not in done.stdout and done.stdout.splitlines()[1].split()[-1] == "n/a", done.stdout
        assert '"coarse_gap_closed": null' in (tmp_path / "rows.json").read_text()


def _readme() -> str:
    """README.md with its line breaks as spaces (a sentence may wrap anywhere)."""
    return " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())


def test_readme_says_a_recorded_runs_replay_matches_its_bytes_moved_only_with_retained_copies_charged_back() -> None:
    # The behaviour is tested in tests/test_live_probe_s.py (as_replay_charges(live) == the replay's
    # bytes_moved); the live stats()["bytes_moved"] leave out the retained NVMe copies taken back.
    text = _readme()
    start = text.index('`TieredKVCache(..., record="steps.jsonl")` writes the step trace')
    sentence = text[start : text.index("a move that failed on the disk", start)]
    assert "byte for byte" in sentence and "as_replay_charges(stats)" in sentence, sentence
    assert "retained_takeups" in sentence, sentence


def test_readme_quotes_arcs_largest_difference_from_libcachesim_on_the_bundled_trace() -> None:
    import json

    from tiercache.sim.sweep import run_sweep

    golden = json.loads((ROOT / "tests" / "data" / "golden_libcachesim.json").read_text())
    trace, accesses = ROOT / "tests" / "data" / golden["trace"], golden["accesses"]
    capacities = sorted(int(c) for c in golden["miss_ratio"]["arc"])
    runs = run_sweep(str(trace), ["arc"], capacities, ["object"])["runs"]
    theirs = {c: round(golden["miss_ratio"]["arc"][str(c)] * accesses) for c in capacities}
    apart = max((abs(r["misses"] - theirs[r["capacity_blocks"]]), r["capacity_blocks"]) for r in runs)
    assert apart == (36, 1000)  # the probe's measurement (libCacheSim 0.3.5's ARC: 110,502 misses, ours 110,538)
    text = _readme()
    assert "below 1.1e-4 on traces of 120k accesses" not in text
    assert f"{apart[0]} of its {accesses:,} accesses at {apart[1]:,} blocks" in text


def test_readme_names_the_runner_up_on_the_conversation_trace_as_gap_closed_measured_it() -> None:
    text = _readme()
    start = text.index("On Mooncake's public conversation trace")
    paragraph = text[start : text.index("In its 3-tier rows", start)]
    assert "(`arc` 5.7%, 4.3%, 7.3%;" not in paragraph, paragraph
    for figure in ("`s3fifo` 6.7% and 12.2%", "`arc` 7.3%", "-44.6%", "--capacity 1000,4000,16000,32000,64000"):
        assert figure in paragraph, (figure, paragraph)
