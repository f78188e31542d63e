"""``tiercache trace``: synth, inspect, export, and one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tiercache.cli import main
from tiercache.config import layout_preset
from tiercache.sim.oracle import read_oracle_general
from tiercache.sim.steptrace import load_flat_steps
from tiercache.sim.traces import load_flat

HEAD = Path(__file__).parent / "data" / "mooncake_head.jsonl"
GOOD = '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}'
GOOD_STEP = '{"step": 0, "layer": 0, "read": [], "write": [0, 1]}'


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _assert_user_error(capsys, argv, *fragments: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2, (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("tiercache trace: error: ")
    for fragment in fragments:
        assert fragment in err


# ----------------------------------------------------------------------------- synth


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("scan", ["--steps", "40", "--blocks", "6", "--block-tokens", "4", "--layers", "2"]),
        ("sparse", ["--steps", "40", "--blocks", "50", "--k", "4", "--seed", "9"]),
        ("docs", ["--docs", "8", "--blocks", "3", "--requests", "40", "--zipf", "0.8", "--seed", "9"]),
    ],
)
def test_synth_writes_deterministic_readable_traces(tmp_path, capsys, kind, extra):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for out in (first, second):
        code, stdout, _ = _run(capsys, "trace", "synth", kind, "-o", out, *extra)
        assert code == 0 and str(out) in stdout
    assert first.read_bytes() == second.read_bytes()
    if kind == "docs":
        assert load_flat(first).num_requests == 40
    else:
        assert load_flat_steps(first).steps[-1] == 40


def test_synth_seed_changes_sparse_trace(tmp_path, capsys):
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"s{seed}.jsonl"
        assert _run(capsys, "trace", "synth", "sparse", "-o", out, "--steps", "30", "--seed", seed)[0] == 0
        outs.append(out.read_bytes())
    assert outs[0] != outs[1]


def test_synth_bad_values(tmp_path, capsys):
    _assert_user_error(capsys, ["trace", "synth", "scan", "-o", tmp_path / "x", "--steps", "0"], "--steps:")
    _assert_user_error(capsys, ["trace", "synth", "sparse", "-o", tmp_path / "x", "--locality", "2"], "locality")
    _assert_user_error(capsys, ["trace", "synth", "docs", "-o", tmp_path / "no" / "x.jsonl"], "cannot write")


# ----------------------------------------------------------------------------- inspect


def test_inspect_request_trace(capsys):
    code, out, _ = _run(capsys, "trace", "inspect", HEAD)
    assert code == 0
    assert "requests" in out and "300" in out and "compulsory miss ratio" in out and "time span" in out


def test_inspect_json_values(capsys):
    code, out, _ = _run(capsys, "trace", "inspect", HEAD, "--json")
    assert code == 0
    stats = json.loads(out)
    ids = load_flat(HEAD).ids
    assert stats["kind"] == "requests" and stats["records"] == 300 and stats["accesses"] == len(ids)
    assert stats["unique_blocks"] == len(np.unique(ids))
    assert stats["compulsory_miss_ratio"] == pytest.approx(len(np.unique(ids)) / len(ids))
    assert 0 <= stats["prefix_hit_ratio_inf"] <= 1 - stats["compulsory_miss_ratio"] + 1e-12
    assert set(stats["record_blocks_pct"]) == {"p50", "p90", "p99", "max"}


def test_inspect_prefix_hits_exact(tmp_path, capsys):
    lines = [
        '{"timestamp": 0, "input_length": 1536, "output_length": 1, "hash_ids": [0, 1, 2]}',
        '{"timestamp": 5, "input_length": 1536, "output_length": 1, "hash_ids": [0, 1, 3]}',
        '{"timestamp": 9, "input_length": 1536, "output_length": 1, "hash_ids": [4, 1, 2]}',
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    stats = json.loads(_run(capsys, "trace", "inspect", path, "--json")[1])
    # Object hits: 0, 1 (req 2), 1, 2 (req 3) = 4 of 9; prefix hits stop at the first new block: 2 of 9.
    assert stats["compulsory_miss_ratio"] == pytest.approx(5 / 9)
    assert stats["prefix_hit_ratio_inf"] == pytest.approx(2 / 9)
    assert stats["time_span"] == "0.009 s"


def test_inspect_step_trace(tmp_path, capsys):
    path = tmp_path / "scan.jsonl"
    _run(capsys, "trace", "synth", "scan", "-o", path, "--steps", "8", "--blocks", "2", "--block-tokens", "4")
    stats = json.loads(_run(capsys, "trace", "inspect", path, "--json")[1])
    # prefill writes 2; steps 1-4 read 2 each, step 4 writes 1; steps 5-8 read 3 each, step 8 writes 1.
    # Accesses are the reads, as replay counts them; the 4 writes are stored, not accessed.
    assert stats["kind"] == "steps" and stats["records"] == 9
    assert stats["accesses"] == 4 * 2 + 4 * 3 and stats["writes"] == 4
    assert stats["unique_blocks"] == 4 and stats["prefix_hit_ratio_inf"] is None
    code, out, _ = _run(capsys, "trace", "inspect", path)
    assert code == 0 and "step records" in out and "steps 0..8" in out


# ----------------------------------------------------------------------------- export


def test_export_request_trace(tmp_path, capsys):
    out = tmp_path / "head.bin"
    code, stdout, _ = _run(capsys, "trace", "export", HEAD, "--format", "oracleGeneral", "-o", out)
    assert code == 0 and "records" in stdout
    rec = read_oracle_general(out)
    np.testing.assert_array_equal(rec["obj_id"], load_flat(HEAD).ids)
    assert set(rec["obj_size"].tolist()) == {1}


def test_export_sizes_from_model(tmp_path, capsys):
    out = tmp_path / "head.bin"
    assert _run(capsys, "trace", "export", HEAD, "-o", out, "--model", "llama-3-8b")[0] == 0
    assert set(read_oracle_general(out)["obj_size"].tolist()) == {layout_preset("llama-3-8b", 512).block_bytes}
    steps = tmp_path / "s.jsonl"
    _run(capsys, "trace", "synth", "scan", "-o", steps, "--steps", "8", "--blocks", "2", "--layers", "32")
    argv = ["trace", "export", steps, "-o", out, "--model", "llama-3-8b", "--block-tokens", "16", "--per-layer"]
    assert _run(capsys, *argv)[0] == 0
    per_layer_bytes = 2 * 8 * 16 * 128 * 2  # K and V, 8 kv heads, 16 tokens, 128 dims, bf16, one layer
    rec = read_oracle_general(out)
    assert set(rec["obj_size"].tolist()) == {per_layer_bytes}
    assert rec["clock_time"].max() == 8  # time of a step trace is the step


def test_export_errors(tmp_path, capsys):
    out = tmp_path / "x.bin"
    _assert_user_error(capsys, ["trace", "export", HEAD, "-o", out, "--model", "gpt-9"], "unknown model preset", "llama-3-8b")
    _assert_user_error(capsys, ["trace", "export", HEAD, "-o", out, "--block-tokens", "16"], "need --model")
    _assert_user_error(capsys, ["trace", "export", HEAD, "-o", tmp_path / "no" / "x.bin"], "cannot write")
    with pytest.raises(SystemExit) as info:
        main(["trace", "export", str(HEAD), "-o", str(out), "--format", "csv"])
    assert info.value.code == 2
    capsys.readouterr()


# ----------------------------------------------------------------------------- bad traces via the CLI


BAD_FILES = [
    (f"{GOOD}\n{{broken\n", ":2: malformed JSON"),
    (f"{GOOD}\n" + '{"timestamp": 1, "input_length": 1, "output_length": 1}\n', ":2: missing field 'hash_ids'"),
    (f"{GOOD}\n" + '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1, true]}\n', ":2: hash_ids[1]"),
    (f"{GOOD}\n" + '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [-3]}\n', ":2: hash_ids[0]"),
    (f"{GOOD}\n\n" + '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": "0 1"}\n', ":3: field 'hash_ids' must be a list"),
    (f"{GOOD_STEP}\n" + '{"step": 0, "layer": 0, "read": ["x"], "write": []}\n', ":2: read[0]"),
    (f"{GOOD_STEP}\n" + '{"step": 0, "layer": 0, "read": [], "write": [1, 1]}\n', ":2: write lists block 1"),
    (f"{GOOD_STEP}\n" + '{"step": 5, "layer": 0, "read": [], "write": []}\n{"step": 4, "layer": 0, "read": [], "write": []}\n', ":3: step 4"),
    ('{"foo": 1}\n', ":1: not a known trace"),
    ("", "empty"),
    ("\n \n", "empty"),
]


@pytest.mark.parametrize("action", ["inspect", "export"])
@pytest.mark.parametrize("text,fragment", BAD_FILES)
def test_bad_trace_one_line_exit_2(tmp_path, capsys, action, text, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    argv = ["trace", action, path] + (["-o", tmp_path / "x.bin"] if action == "export" else [])
    _assert_user_error(capsys, argv, str(path), fragment)


@pytest.mark.parametrize("action", ["inspect", "export"])
def test_missing_file_and_directory(tmp_path, capsys, action):
    for path in (tmp_path / "missing.jsonl", tmp_path):
        argv = ["trace", action, path] + (["-o", tmp_path / "x.bin"] if action == "export" else [])
        _assert_user_error(capsys, argv, str(path), "cannot open trace")
