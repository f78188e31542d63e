"""Probe findings on trace input: kv-cache-tester bounds, ``trace export`` block sizes and
outputs, ``trace synth`` option checks. Every bad input is a one-line error with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiercache.cli import main
from tiercache.config import layout_preset
from tiercache.errors import TraceError
from tiercache.sim import synth
from tiercache.sim.loader import load_trace
from tiercache.sim.oracle import read_oracle_general
from tiercache.sim.traces import Request

DATA = Path(__file__).parent / "data"
HEAD = DATA / "mooncake_head.jsonl"
REQ = {"t": 0, "in": 1, "out": 1, "hash_ids": [1]}


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _user_error(capsys, *argv) -> str:
    """Runs the CLI, checks a one-line error with exit code 2, returns the line."""
    code, out, err = _run(capsys, *argv)
    assert code == 2, (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def _conv(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _conv_json(path: Path, **fields) -> Path:
    return _conv(path, json.dumps({"block_size": 64, "requests": [REQ]} | fields))


# ----------------------------------------------------------------------------- 4: local id renumbering


@pytest.mark.parametrize("first", [
    {"requests": [dict(REQ, hash_ids=[2**63 - 1])]},  # local: the next conversation starts at 2**63
    {"requests": [dict(REQ, hash_ids=[2**63 - 1])], "hash_id_scope": "global"},  # global id 2**63 - 1
    {"requests": [dict(REQ, hash_ids=[2**62])]},
])
def test_kvtester_local_ids_past_int64_are_refused_naming_the_file(tmp_path, capsys, first):
    _conv_json(tmp_path / "a.json", **first)
    _conv_json(tmp_path / "b.json", requests=[dict(REQ, hash_ids=[2**62])])
    with pytest.raises(TraceError, match="b.json.*local hash_ids.*2\\*\\*63"):
        load_trace(tmp_path)
    assert "b.json" in _user_error(capsys, "replay", tmp_path, "--capacity", "2", "--no-progress")


def test_kvtester_ids_that_fit_are_renumbered_as_documented(tmp_path):
    _conv_json(tmp_path / "a.json", requests=[dict(REQ, hash_ids=[2**62])])
    _conv_json(tmp_path / "b.json", requests=[dict(REQ, hash_ids=[5])])
    assert load_trace(tmp_path).ids.tolist() == [2**62, 2**62 + 1 + 5]


# ----------------------------------------------------------------------------- 5: huge t / start


@pytest.mark.parametrize("text,fragment", [
    ('{"block_size": 64, "requests": [{"t": 1e300, "in": 1, "out": 1, "hash_ids": [1]}]}', "requests[0].t"),
    ('{"block_size": 64, "requests": [{"t": 1' + "0" * 400 + ', "in": 1, "out": 1, "hash_ids": [1]}]}', "requests[0].t"),
    ('{"block_size": 64, "start": 1e300, "requests": [{"t": 0, "in": 1, "out": 1, "hash_ids": [1]}]}', "start"),
    ('{"block_size": 64, "start": 9e15, "requests": [{"t": 9e15, "in": 1, "out": 1, "hash_ids": [1]}]}', "requests[0] arrives"),
    ('{"block_size": 64, "requests": [{"t": 0, "in": 1' + "0" * 30 + ', "out": 1, "hash_ids": [1]}]}', "requests[0].in"),
])
def test_kvtester_times_and_counts_past_int64_name_the_file_and_request(tmp_path, capsys, text, fragment):
    _conv(tmp_path / "a.json", text)
    err = _user_error(capsys, "replay", tmp_path, "--capacity", "2", "--no-progress")
    assert "a.json" in err and fragment in err and len(err) < 400


# ----------------------------------------------------------------------------- 6: block sizes


def test_kvtester_block_size_is_bounded(tmp_path, capsys):
    _conv_json(tmp_path / "a.json", block_size=2**70)
    err = _user_error(capsys, "replay", tmp_path, "--capacity", "2", "--semantics", "prefix", "--no-progress")
    assert "a.json" in err and "block_size" in err and "2**31" in err


def test_step_header_block_tokens_is_bounded(tmp_path, capsys):
    text = '{"block_tokens": 4611686018427387904}\n{"step": 0, "layer": 0, "read": [], "write": [0]}\n'
    path = _conv(tmp_path / "s.jsonl", text)
    err = _user_error(capsys, "trace", "export", path, "-o", tmp_path / "x.bin", "--model", "llama-3-8b")
    assert "s.jsonl:1" in err and "2**31" in err


# ----------------------------------------------------------------------------- 25: BOM


def test_kvtester_file_with_a_bom_is_refused_as_in_jsonl(tmp_path, capsys):
    _conv(tmp_path / "a.json", b"\xef\xbb\xbf" + json.dumps({"block_size": 64, "requests": [REQ]}).encode())
    assert "BOM" in _user_error(capsys, "replay", tmp_path, "--capacity", "2", "--no-progress")
    jsonl = _conv(tmp_path / "t.jsonl", b'\xef\xbb\xbf{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n')
    assert "BOM" in _user_error(capsys, "replay", jsonl, "--capacity", "2", "--no-progress")


def test_kvtester_file_not_utf8_is_refused(tmp_path):
    _conv(tmp_path / "a.json", json.dumps({"block_size": 64, "requests": [REQ]}).encode("utf-16"))
    with pytest.raises(TraceError, match="a.json"):
        load_trace(tmp_path)


# ----------------------------------------------------------------------------- 7: export block sizes


@pytest.mark.parametrize("trace,tokens", [(DATA / "kvtester_sample", 64), (DATA / "bailian_sample.jsonl", 16), (HEAD, 512)])
def test_export_sizes_request_blocks_at_the_trace_block_size(tmp_path, capsys, trace, tokens):
    out = tmp_path / "x.bin"
    assert _run(capsys, "trace", "export", trace, "-o", out, "--model", "llama-3-8b")[0] == 0
    assert set(read_oracle_general(out)["obj_size"].tolist()) == {layout_preset("llama-3-8b", tokens).block_bytes}


def _steps(tmp_path: Path, header: bool) -> Path:
    path = tmp_path / "s.jsonl"
    assert main(["trace", "synth", "scan", "-o", str(path), "--steps", "8", "--blocks", "2", "--block-tokens", "16"]) == 0
    if not header:
        path.write_text("".join(path.read_text().splitlines(keepends=True)[1:]))
    return path


def test_export_refuses_what_replay_refuses(tmp_path, capsys):
    out = tmp_path / "x.bin"
    headerless = _steps(tmp_path, header=False)
    assert "give --block-tokens" in _user_error(capsys, "trace", "export", headerless, "-o", out, "--model", "llama-3-8b")
    assert _run(capsys, "trace", "export", headerless, "-o", out, "--model", "llama-3-8b", "--block-tokens", "32")[0] == 0
    assert set(read_oracle_general(out)["obj_size"].tolist()) == {layout_preset("llama-3-8b", 32).block_bytes // 32}  # one layer of 32
    headed = _steps(tmp_path, header=True)
    err = _user_error(capsys, "trace", "export", headed, "-o", out, "--model", "llama-3-8b", "--block-tokens", "32")
    assert "--block-tokens 32" in err and "16" in err
    assert "--per-layer" in _user_error(capsys, "trace", "export", HEAD, "-o", out, "--model", "llama-3-8b", "--per-layer")
    assert "--block-tokens" in _user_error(capsys, "trace", "export", HEAD, "-o", out, "--model", "llama-3-8b",
                                           "--block-tokens", "512")


# ----------------------------------------------------------------------------- 13: output over the input


def test_export_refuses_to_overwrite_its_input(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(HEAD.read_bytes())
    assert "input trace" in _user_error(capsys, "trace", "export", trace, "-o", trace)
    (tmp_path / "link.jsonl").hardlink_to(trace)
    assert "input trace" in _user_error(capsys, "trace", "export", trace, "-o", tmp_path / "link.jsonl")
    assert trace.read_bytes() == HEAD.read_bytes()
    folder = tmp_path / "kv"
    _conv_json(folder / "a.json")
    assert "inside the input trace folder" in _user_error(capsys, "trace", "export", folder, "-o", folder / "b.json")
    assert not (folder / "b.json").exists()


# ----------------------------------------------------------------------------- 12, 22: synth options


@pytest.mark.parametrize("argv,option", [
    (["docs", "--rate", "nan"], "--rate"),
    (["docs", "--rate", "inf"], "--rate"),
    (["docs", "--rate", "0"], "--rate"),
    (["docs", "--zipf", "nan"], "--zipf"),
    (["docs", "--blocks", "0"], "--blocks"),
    (["sparse", "--locality", "nan"], "--locality"),
    (["sparse", "--locality", "-1"], "--locality"),
    (["sparse", "--locality", "1.5"], "--locality"),
    (["scan", "--steps", "0"], "--steps"),
    (["scan", "--blocks", "-1"], "--blocks"),
    (["scan", "--block-tokens", str(2**40)], "--block-tokens"),
])
def test_synth_refuses_bad_values_naming_the_option(tmp_path, capsys, argv, option):
    out = tmp_path / "x.jsonl"
    err = _user_error(capsys, "trace", "synth", argv[0], "-o", out, *argv[1:])
    assert err.startswith(f"tiercache trace: error: {option}: ") and "Spec." not in err
    assert not out.exists()


def test_synth_locality_messages_agree():
    messages = set()
    for value in (-1.0, 1.5):
        with pytest.raises(synth.SpecError) as info:
            synth.SparseSpec(steps=5, locality=value)
        messages.add(info.value.reason.split(", got")[0])
    assert messages == {"must be a number in [0.0, 1.0]"}


def test_synth_rate_too_low_for_the_timestamps_is_refused(tmp_path, capsys):
    out = tmp_path / "d.jsonl"
    err = _user_error(capsys, "trace", "synth", "docs", "-o", out, "--rate", "1e-9", "--requests", "10000000")
    assert "--rate" in err and "2**63 ms" in err and not out.exists()


# ----------------------------------------------------------------------------- 10: huge synth sizes, partial files


@pytest.mark.parametrize("argv", [
    ["scan", "--blocks", "1000000000", "--steps", "1"],
    ["scan", "--blocks", "4611686018427387904", "--layers", "4"],
    ["sparse", "--blocks", "100000000", "--k", "4"],
    ["docs", "--blocks", "100000000"],
])
def test_synth_refuses_sizes_the_readers_refuse_before_writing(tmp_path, capsys, argv):
    out = tmp_path / "big.jsonl"
    err = _user_error(capsys, "trace", "synth", argv[0], "-o", out, *argv[1:])
    assert "--blocks" in err
    assert list(tmp_path.iterdir()) == []


def test_synth_failure_leaves_no_partial_file_and_keeps_the_old_one(tmp_path, capsys, monkeypatch):
    out = tmp_path / "d.jsonl"
    out.write_text("old\n")

    def exhausted(spec):  # one line written, then out of memory
        yield Request(0, 512, 1, (0,), 0)
        raise MemoryError

    monkeypatch.setattr(synth, "docs_trace", exhausted)
    assert "does not fit in memory" in _user_error(capsys, "trace", "synth", "docs", "-o", out)
    assert out.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["d.jsonl"]


# ----------------------------------------------------------------------------- 23: sparse on an empty sequence


def test_sparse_with_no_full_block_says_so(tmp_path, capsys):
    argv = ["--blocks", "0", "--sink", "0", "--window", "0", "--k", "1", "--steps", "16"]
    err = _user_error(capsys, "trace", "synth", "sparse", "-o", tmp_path / "s.jsonl", *argv)
    assert "no step reads a block" in err and "cover all 0 blocks" not in err
