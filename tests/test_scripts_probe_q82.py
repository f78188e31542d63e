"""Probe Q82 (the scripts and ``tiercache trace``): gap_closed, belady_gap, class_bound,
policy_zoo and bench_replay replaced their input trace with their --json (rc 0, no word);
bench_put_policies took a --batch above --slots and failed on an empty median; scripts ended
in tracebacks for sizes the machine cannot hold; bench_quant printed transformers' nominal
byte ratios beside measured ones without saying so."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tiercache.bench.script_args import run_script
from tiercache.errors import UserError

from test_script_bench_honesty import _script

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("name, argv", [
    ("gap_closed", ["--trace", "{t}", "--capacity", "10", "--json", "{t}"]),
    ("policy_zoo", ["--trace", "{t}", "--capacity", "10", "--json", "{t}"]),
    ("belady_gap", ["{t}", "--capacity", "10", "--json", "{t}"]),
    ("class_bound", ["{t}", "--capacity", "10", "--json", "{t}"]),
    ("bench_replay", ["--trace", "{t}", "--json", "{t}"]),
])
def test_a_json_output_that_is_the_input_trace_is_refused_untouched(tmp_path, capsys, name, argv):
    trace = tmp_path / "t.jsonl"
    shutil.copy(DATA / "mooncake_head.jsonl", trace)
    before = trace.read_bytes()
    script = _script(name)
    main = getattr(script, "main")
    with pytest.raises(SystemExit) as info:
        main([a.replace("{t}", str(trace)) for a in argv])
    assert info.value.code == 2
    assert "is the trace being replayed; writing results there would overwrite it" in capsys.readouterr().err
    assert trace.read_bytes() == before


def test_a_put_batch_above_the_slots_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        _script("bench_put_policies").parse(["--slots", "10", "--batch", "20", "--policy", "lru"])
    assert info.value.code == 2
    assert "--batch 20: at most --slots 10" in capsys.readouterr().err


@pytest.mark.parametrize("raised, code, said", [(UserError("too big"), 2, "error: too big"),
                                                 (MemoryError(), 1, "error: out of memory"),
                                                 (RuntimeError("DefaultCPUAllocator: can't allocate memory"), 1,
                                                  "error: out of memory")])
def test_a_script_ends_a_late_refusal_in_one_line(capsys, monkeypatch, raised, code, said):
    monkeypatch.setattr(sys, "argv", ["bench_x.py"])

    def main():
        raise raised

    assert run_script(main) == code
    err = capsys.readouterr().err
    assert err.startswith(f"bench_x.py: {said}") and err.count("\n") == 1


def test_run_script_leaves_other_errors_alone():
    def main():
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        run_script(main)


def test_bench_decode_refuses_a_sequence_its_disk_cannot_hold(tmp_path, capsys):
    """Probe Q82-4: --tokens 1e11 started writing (4.1 GB in 60 s) until the disk filled."""
    with pytest.raises(SystemExit) as info:
        _script("bench_decode").parse_args(["--tokens", "100000000000", "--path", str(tmp_path)])
    assert info.value.code == 2
    assert "--tokens 100000000000: the NVMe store needs" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
