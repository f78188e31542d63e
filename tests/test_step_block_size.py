"""A step trace names its block size in a header record (issue 8 item 16)."""

from __future__ import annotations

import json

import pytest

from tiercache.cli import main
from tiercache.sim.loader import load_trace
from tiercache.sim.steptrace import load_flat_steps


@pytest.fixture()
def scan(tmp_path, capsys):
    path = tmp_path / "scan.jsonl"
    assert main(["trace", "synth", "scan", "-o", str(path), "--blocks", "8", "--steps", "64", "--block-tokens", "16"]) == 0
    capsys.readouterr()
    return path


def _replay(capsys, path, *extra):
    out = path.parent / "r.json"
    code = main(["replay", str(path), "--capacity", "4", "--no-progress", "--workers", "1", "--out", str(out), *extra])
    _, err = capsys.readouterr()
    return code, err, (json.loads(out.read_text()) if code == 0 else None)


def test_generators_write_the_header_and_readers_skip_it(scan):
    assert json.loads(scan.read_text().splitlines()[0]) == {"block_tokens": 16}
    trace = load_trace(scan)
    assert trace.block_tokens == 16 and trace.records == 65
    assert len(load_flat_steps(scan).ids) == len(trace.ids)


def test_model_bytes_use_the_trace_block_size(scan, capsys):
    code, err, doc = _replay(capsys, scan, "--model", "llama-3-8b")
    assert code == 0, err
    assert doc["layout"]["block_tokens"] == 16 and doc["layout"]["block_bytes"] == 16 * 128 * 1024 // 32  # one of llama-3-8b's 32 layers


def test_old_file_without_header_needs_block_tokens(scan, capsys):
    old = scan.parent / "old.jsonl"
    old.write_text("\n".join(scan.read_text().splitlines()[1:]) + "\n")
    code, err, _ = _replay(capsys, old, "--model", "llama-3-8b")
    assert code == 2 and "names no block size" in err and "--block-tokens" in err
    code, err, doc = _replay(capsys, old, "--model", "llama-3-8b", "--block-tokens", "16")
    assert code == 0 and doc["layout"]["block_tokens"] == 16
    code, err, doc = _replay(capsys, old)  # counting blocks needs no block size
    assert code == 0, err


def test_conflicting_block_tokens_is_an_error(scan, capsys):
    code, err, _ = _replay(capsys, scan, "--model", "llama-3-8b", "--block-tokens", "32")
    assert code == 2 and "names 16 tokens per block" in err


def test_bad_header_names_the_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"block_tokens": 0}\n{"step": 0, "layer": 0, "read": [], "write": [1]}\n')
    code, err, _ = _replay(capsys, path)
    assert code == 2 and f"{path}:1:" in err and "block_tokens" in err


def test_step_trace_report_says_step_trace_and_has_no_floor(scan, capsys):
    out = scan.parent / "report"
    assert main(["compare", str(scan), "--policy", "lru,belady", "--capacity", "4,8", "--no-progress", "--workers", "1",
                 "-o", str(out)]) == 0, capsys.readouterr().err
    text = (out / "report.md").read_text()
    assert "step trace" in text and "request trace" not in text and "compulsory-miss floor" not in text
