"""Probe Q8 findings on ``tiercache trace``: ``synth sparse --locality`` is the stay
probability it is documented as, step-trace ``inspect`` per-block figures count reads only
(blocks written and never read have their own row), ``synth scan`` refuses a trace without
reads, and a large ``--zipf`` writes no numpy warning."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from tiercache.cli import main
from tiercache.sim import synth
from tiercache.sim.steptrace import load_flat_steps
from tiercache.sim.tracestats import trace_stats

HEAD = Path(__file__).parent / "data" / "mooncake_head.jsonl"


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _rows(out: str) -> dict[str, str]:
    """``inspect``'s table as {label: value} (labels and values are split by 2+ spaces)."""
    rows = {}
    for line in out.splitlines():
        label, _, value = line.partition("  ")
        rows[label.strip()] = value.strip()
    return rows


# ----------------------------------------------------------------------------- F1: --locality


def _middles(spec: synth.SparseSpec) -> list[set[int]]:
    """The middle choice of each decode step (layer 0, one layer): the reads between sinks and window."""
    records = [r for r in synth.sparse_trace(spec) if r.step > 0]
    return [set(r.read[spec.sink: len(r.read) - spec.window]) for r in records]


def _stay_share(middles: list[set[int]]) -> float:
    """Of the middle blocks chosen at a step, the share chosen again at the next step."""
    stayed = sum(len(a & b) for a, b in zip(middles, middles[1:]))
    return stayed / sum(len(a) for a in middles[:-1])


@pytest.mark.parametrize("locality", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_sparse_locality_is_the_probability_a_chosen_block_stays_chosen(locality):
    # a middle of 35..47 blocks (>= 2k): the refill always finds enough blocks not just chosen
    spec = synth.SparseSpec(steps=400, prompt_blocks=40, k=16, sink=1, window=4, locality=locality,
                            block_tokens=40, seed=0)
    share = _stay_share(_middles(spec))  # ~6,400 trials: binomial sd <= 0.0063
    assert share == pytest.approx(locality, abs=0.025), share


def test_sparse_refill_takes_dropped_blocks_only_when_the_unchosen_run_out():
    # a middle of 20 blocks, k = 16: only 4 unchosen blocks, so every step reads all of them
    spec = synth.SparseSpec(steps=200, prompt_blocks=25, k=16, sink=1, window=4, locality=0.0,
                            block_tokens=10_000, seed=5)
    middles = _middles(spec)
    middle = set(range(1, 21))
    for previous, current in zip(middles, middles[1:]):
        assert len(current) == 16 and current <= middle
        assert middle - previous <= current  # every block not chosen before is chosen now


def test_sparse_trace_with_the_cli_agrees_and_says_so_in_help(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    assert _run(capsys, "trace", "synth", "sparse", "-o", out, "--blocks", "40", "--steps", "300", "--k", "16",
                "--window", "4", "--locality", "0", "--block-tokens", "1000")[0] == 0
    reads = [json.loads(line)["read"] for line in out.read_text().splitlines()[2:]]  # header, prefill
    middles = [set(r[1:-4]) for r in reads]
    assert _stay_share(middles) == 0.0  # --locality 0: a chosen block is never chosen next step
    with pytest.raises(SystemExit):
        main(["trace", "synth", "sparse", "--help"])
    assert "not chosen at that step" in " ".join(capsys.readouterr().out.split())


# ----------------------------------------------------------------------------- F2: inspect


def _write_steps(path: Path, records: list[dict]) -> Path:
    path.write_text(json.dumps({"block_tokens": 16}) + "\n" + "".join(json.dumps(r) + "\n" for r in records))
    return path


def test_inspect_per_block_figures_count_blocks_read_only(tmp_path, capsys):
    path = _write_steps(tmp_path / "t.jsonl", [{"step": 0, "layer": 0, "read": [], "write": list(range(10))},
                                               {"step": 1, "layer": 0, "read": [0], "write": []},
                                               {"step": 2, "layer": 0, "read": [0, 1], "write": []}])
    stats = trace_stats(path)
    assert (stats.accesses, stats.unique_blocks, stats.blocks_never_read) == (3, 10, 8)
    # blocks read: 0 (twice) and 1 (once): half are read once, 1.5 reads each
    assert (stats.blocks_accessed_once, stats.accesses_per_block_mean, stats.accesses_per_block_max) == (0.5, 1.5, 2)
    code, out, _ = _run(capsys, "trace", "inspect", path)
    rows = _rows(out)
    assert code == 0 and rows["blocks written, never read"] == "8 of 10"
    assert rows["blocks accessed once"] == "0.500" and rows["accesses per block"].startswith("mean=1.500 ")
    shown = json.loads(_run(capsys, "trace", "inspect", path, "--json")[1])
    assert (shown["blocks_never_read"], shown["blocks_accessed_once"], shown["accesses_per_block_mean"]) == (8, 0.5, 1.5)


def test_inspect_figures_on_the_readme_sparse_example_match_a_count_of_its_reads(tmp_path, capsys):
    path = tmp_path / "sparse.jsonl"
    argv = ["--blocks", "4096", "--steps", "1024", "--k", "32", "--sink", "1", "--window", "4", "--locality", "0.9"]
    assert _run(capsys, "trace", "synth", "sparse", "-o", path, *argv, "--seed", "0")[0] == 0
    steps = load_flat_steps(path)
    reads = np.bincount(steps.ids[~steps.is_write])
    read_counts = reads[reads > 0]
    stats = trace_stats(path)
    assert stats.unique_blocks == 4160 and stats.blocks_never_read == 4160 - len(read_counts) == 1835
    assert stats.blocks_accessed_once == pytest.approx(np.mean(read_counts == 1))
    assert stats.accesses_per_block_mean == pytest.approx(37_888 / len(read_counts))
    rows = _rows(_run(capsys, "trace", "inspect", path)[1])
    assert rows["blocks written, never read"] == "1,835 of 4,160"
    assert (rows["blocks accessed once"], rows["accesses per block"]) == ("0.063", "mean=16.296  max=1024")


def test_a_request_trace_has_no_never_read_row(capsys):
    stats = trace_stats(HEAD)
    assert stats.blocks_never_read is None
    assert stats.accesses_per_block_mean == pytest.approx(stats.accesses / stats.unique_blocks)
    assert "never read" not in _run(capsys, "trace", "inspect", HEAD)[1]


# ----------------------------------------------------------------------------- F3: scan without reads


@pytest.mark.parametrize("steps", [1, 16])
def test_scan_with_no_block_read_is_refused_up_front(tmp_path, capsys, steps):
    out = tmp_path / "s.jsonl"
    code, _, err = _run(capsys, "trace", "synth", "scan", "-o", out, "--blocks", "0", "--steps", steps)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("tiercache trace: error: --blocks 0 with --steps") and "no step reads a block" in err
    assert not out.exists()
    assert _run(capsys, "trace", "synth", "scan", "-o", out, "--blocks", "0", "--steps", "17")[0] == 0  # 1 read


# ----------------------------------------------------------------------------- F4: --zipf


def test_a_large_zipf_draws_without_a_warning():
    spec = synth.DocsSpec(docs=1000, doc_blocks=2, requests=50, zipf=200.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        requests = list(synth.docs_trace(spec))
    assert [str(w.message) for w in caught] == []
    assert {r.hash_ids[2] for r in requests} == {2}  # rank 1 (document 0) takes all the weight


def test_the_cli_prints_nothing_on_stderr_for_a_large_zipf(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    proc = subprocess.run([sys.executable, "-m", "tiercache", "trace", "synth", "docs", "-o", str(tmp_path / "d.jsonl"),
                           "--docs", "1000", "--requests", "3", "--zipf", "200"], capture_output=True, text=True, env=env)
    assert (proc.returncode, proc.stderr) == (0, "")


def test_docs_traces_of_usual_exponents_are_unchanged(tmp_path, capsys):
    out = tmp_path / "docs.jsonl"  # the README's command; its bytes as before the fix
    assert _run(capsys, "trace", "synth", "docs", "-o", out, "--docs", "100", "--blocks", "32", "--requests", "1000",
                "--zipf", "1.0", "--seed", "0")[0] == 0
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert digest == "f45cf8c51d5432b4cac592869b700b39b601dc5b2297016edda5578b199a3c07"
    for exponent in (0.0, 0.5, 1.0, 2.5, 100.0):
        ranks = np.arange(1, 1001, dtype=np.float64)
        plain = 1.0 / ranks**exponent
        assert np.array_equal(synth._zipf_probabilities(1000, exponent), plain / plain.sum())
