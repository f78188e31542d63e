"""Probe R6: a FIFO or device where a file is expected is refused in one line, never read
(a FIFO blocked the read forever, a device never ended it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiercache.errors import UserError
from tiercache.results import read_results
from tiercache.sim.hardware import load_profile

SAMPLE = str(Path(__file__).parent / "data" / "mooncake_head.jsonl")
ROOT = Path(__file__).parent.parent


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe.json"
    os.mkfifo(path)
    return path


def test_a_fifo_hardware_profile_is_refused_unread(fifo):
    with pytest.raises(UserError, match="not a regular file"):
        load_profile(str(fifo))


def test_replay_with_a_fifo_hardware_profile_ends_in_one_line(fifo):
    done = subprocess.run([sys.executable, "-m", "tiercache", "replay", SAMPLE, "--tiers", "hbm=4,dram=8", "--model",
                           "llama-3-8b", "--hardware", str(fifo), "--no-progress"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "not a regular file" in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]


def test_a_fifo_results_file_is_named_as_such(fifo):
    with pytest.raises(UserError, match="not a regular file"):
        read_results(fifo)


@pytest.mark.parametrize("trace", ["fifo", "missing"])
def test_bench_replay_refuses_a_trace_that_is_not_a_file_in_one_line(fifo, tmp_path, trace):
    path = fifo if trace == "fifo" else tmp_path / "missing.jsonl"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_replay.py"), "--trace", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("not a trace file (missing, a folder, a device or a FIFO)")
