"""Probe P4 (request-trace loaders): repeated ids inside a request are replayed as listed and
counted by ``trace inspect``; a kv-cache-tester conversation file is read bounded (a device, a
FIFO or an oversized file is refused by name); the workload's fingerprint hashes the seed and
gap in canonical form and refuses a seed that is not an integer; ties between conversations
are broken at the stored millisecond by file order."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tiercache.cli import main
from tiercache.errors import TraceError
from tiercache.sim import kvtester
from tiercache.sim.loader import load_trace
from tiercache.sim.tracestats import trace_stats

HEAD = Path(__file__).parent / "data" / "mooncake_head.jsonl"


def _conv(path: Path, requests: list[dict], **extra) -> Path:
    path.write_text(json.dumps({"block_size": 16, "requests": requests, **extra}))
    return path


def _req(t: float, ids: list[int], tokens_in: int | None = None) -> dict:
    return {"t": t, "in": 16 * len(ids) if tokens_in is None else tokens_in, "out": 1, "hash_ids": ids}


def _jsonl_with_repeats(path: Path) -> Path:
    """Records on lines 2, 4, 5 and 6 (1 and 3 blank); the records on lines 4 and 6 repeat an id."""
    lines = ["", '{"timestamp": 0, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]}', "  ",
             '{"timestamp": 5, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 1]}',
             '{"timestamp": 6, "input_length": 1024, "output_length": 1, "hash_ids": [8, 9]}',
             '{"timestamp": 7, "input_length": 1024, "output_length": 1, "hash_ids": [4, 4]}']
    path.write_text("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------- repeated ids


def test_a_request_repeating_an_id_loads_as_listed_and_inspect_names_its_line(tmp_path, capsys):
    path = _jsonl_with_repeats(tmp_path / "rep.jsonl")
    assert load_trace(path).ids.tolist() == [1, 2, 3, 1, 2, 1, 8, 9, 4, 4]  # replayed as listed
    stats = trace_stats(path)
    assert (stats.repeat_requests, stats.first_repeat) == (2, f"{path}:4")  # the 2nd record, 4th line
    # the other figures of such a request: a repeated id is one block, each listing an access
    assert (stats.accesses, stats.unique_blocks) == (10, 6)
    assert stats.compulsory_miss_ratio == pytest.approx(6 / 10)  # repeats hit, as object semantics
    assert stats.prefix_hit_ratio_inf == pytest.approx(3 / 10)  # [1, 2, 1] after [1, 2, 3]: 3 hits
    assert (stats.tree_depth_pct["p50"], stats.tree_depth_pct["max"]) == (0.5, 2)  # depths 0,1,2 | 0,1 | 0
    assert main(["trace", "inspect", str(path)]) == 0
    rows = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    assert f"requests repeating an id 2 (first: {path}:4)" in rows
    assert main(["trace", "inspect", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["repeat_requests"], shown["first_repeat"]) == (2, f"{path}:4")


def test_a_trace_without_repeats_says_zero():
    stats = trace_stats(HEAD)
    assert (stats.repeat_requests, stats.first_repeat) == (0, None)


def test_inspect_names_the_conversation_request_that_repeats_an_id(tmp_path):
    _conv(tmp_path / "a.json", [_req(0, [0, 1]), _req(9, [0, 1, 2])], start=0)
    b = _conv(tmp_path / "b.json", [_req(0, [5]), _req(1, [5, 6, 5]), _req(2, [7, 7])], start=1)
    assert load_trace(tmp_path).records == 5
    stats = trace_stats(tmp_path)
    assert (stats.repeat_requests, stats.first_repeat) == (2, f"{b} requests[1]")


def test_request_origin_follows_the_poisson_arrival_order(tmp_path):
    for i in range(6):  # no start: seeded Poisson arrivals; "in" tells the requests apart
        _conv(tmp_path / f"c{i}.json", [_req(t, [t], tokens_in=100 * i + t) for t in range(3)])
    for seed in (0, 3):
        trace = load_trace(tmp_path, arrival_seed=seed)
        for index, tokens in enumerate(trace.requests.input_lengths.tolist()):
            file, request = kvtester.request_origin(tmp_path, index, seed)
            assert json.loads(Path(file).read_text())["requests"][request]["in"] == tokens


# ----------------------------------------------------------------------------- bounded reads


def test_a_conversation_file_over_the_limit_is_refused_by_name(tmp_path, monkeypatch):
    path = _conv(tmp_path / "big.json", [_req(0, list(range(40)))])
    monkeypatch.setattr(kvtester, "MAX_CONVERSATION_BYTES", os.path.getsize(path) - 1)
    with pytest.raises(TraceError, match=r"big\.json: larger than 0 MiB, the limit for one conversation file"):
        load_trace(tmp_path)
    monkeypatch.setattr(kvtester, "MAX_CONVERSATION_BYTES", os.path.getsize(path))  # exactly the limit: read
    assert load_trace(tmp_path).records == 1


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # the old reader read /dev/zero until this


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_device_or_fifo_conversation_is_refused_in_one_line(tmp_path, kind):
    folder = tmp_path / "kvt"
    folder.mkdir()
    _conv(folder / "a.json", [_req(0, [1])])
    bad = folder / "b.json"
    if kind == "device":
        bad.symlink_to("/dev/zero")
    else:
        os.mkfifo(bad)
    done = subprocess.run([sys.executable, "-m", "tiercache", "trace", "inspect", str(folder)], capture_output=True,
                          text=True, timeout=60, preexec_fn=_limit_memory)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"tiercache trace: error: {bad}: cannot open trace: not a regular file (a device, FIFO or socket); "
        "a conversation must be a JSON file"]


@pytest.mark.parametrize("kind, name", [("device", "zero.jsonl"), ("fifo", "pipe.jsonl"), ("fifo", "pipe.json")])
@pytest.mark.parametrize("command, options", [(["trace", "inspect"], []), (["replay"], ["--capacity", "4", "--no-progress"])])
def test_a_device_or_fifo_given_as_the_trace_is_refused_in_one_line(tmp_path, kind, name, command, options):
    """Given directly (not inside a folder), a FIFO blocked the first read forever."""
    bad = tmp_path / name
    if kind == "device":
        bad.symlink_to("/dev/zero")
    else:
        os.mkfifo(bad)
    done = subprocess.run([sys.executable, "-m", "tiercache", *command, str(bad), *options], capture_output=True,
                          text=True, timeout=60, preexec_fn=_limit_memory)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].endswith(
        f"{bad}: cannot open trace: not a regular file (a device, FIFO or socket)")


# ----------------------------------------------------------------------------- fingerprint, seed, ties


def test_the_fingerprint_hashes_the_gap_and_seed_in_canonical_form(tmp_path):
    _conv(tmp_path / "a.json", [_req(0, [1])])
    _conv(tmp_path / "b.json", [_req(0, [1])])
    base = load_trace(tmp_path)
    for seed, gap in [(0, 2), (0, np.float64(2.0)), (np.int64(0), 2.0)]:
        same = load_trace(tmp_path, arrival_seed=seed, mean_gap_s=gap)
        assert same.fingerprint == base.fingerprint
        assert np.array_equal(same.requests.timestamps, base.requests.timestamps)
    assert load_trace(tmp_path, mean_gap_s=3).fingerprint != base.fingerprint
    assert load_trace(tmp_path, arrival_seed=1).fingerprint != base.fingerprint


@pytest.mark.parametrize("seed, error", [(None, TypeError), (True, TypeError), (1.0, TypeError), ("0", TypeError),
                                         (-1, ValueError)])
def test_a_seed_that_is_not_a_non_negative_integer_is_refused(tmp_path, seed, error):
    _conv(tmp_path / "a.json", [_req(0, [1])])
    with pytest.raises(error, match="arrival_seed must be"):
        load_trace(tmp_path, arrival_seed=seed)


def test_a_gap_that_is_not_a_number_is_refused(tmp_path):
    _conv(tmp_path / "a.json", [_req(0, [1])])
    with pytest.raises(TypeError, match="mean_gap_s must be a number"):
        load_trace(tmp_path, mean_gap_s="2")


def test_a_tie_at_the_stored_millisecond_goes_by_file_order(tmp_path):
    a = _conv(tmp_path / "a.json", [_req(0.2, [10])], start=0.1, hash_id_scope="global")  # 0.1 + 0.2 > 0.3 as floats
    _conv(tmp_path / "b.json", [_req(0.0, [20])], start=0.3, hash_id_scope="global")
    trace = load_trace(tmp_path)
    assert trace.requests.timestamps.tolist() == [300, 300]
    assert trace.ids.tolist() == [10, 20]  # a.json first, as the docstring promises
    assert kvtester.request_origin(tmp_path, 0) == (str(a), 0)
