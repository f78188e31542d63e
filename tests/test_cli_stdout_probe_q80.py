"""Probe Q80 on the command's standard output: ``replay --out`` printed its tables before it
wrote the results file, so a reader that went away (``| head``, ``| true``) or a full disk
under ``>`` lost the file; a full or closed standard output ended in a traceback."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

TRACE = Path(__file__).parent / "data" / "mooncake_head.jsonl"
REPLAY = [sys.executable, "-m", "tiercache", "replay", str(TRACE), "--policy", "lru,fifo", "--capacity", "50,100",
          "--workers", "1", "--no-progress"]


def _env(unbuffered: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.mark.parametrize("unbuffered", [False, True])
def test_a_reader_that_goes_away_never_loses_the_results_file(tmp_path, unbuffered):
    out = tmp_path / "r.json"
    reader_gone = subprocess.Popen(["true"], stdin=subprocess.PIPE)
    reader_gone.wait()  # the pipe's reader has exited: every write to it fails
    done = subprocess.run([*REPLAY, "--out", str(out)], stdout=reader_gone.stdin, stderr=subprocess.PIPE,
                          env=_env(unbuffered), timeout=120)
    reader_gone.stdin.close()
    assert done.returncode == 141 and done.stderr == b""
    assert len(json.loads(out.read_text())["runs"]) == 4


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("unbuffered", [False, True])
def test_a_full_disk_under_standard_output_is_one_line_and_the_results_file_is_written(tmp_path, unbuffered):
    out = tmp_path / "r.json"
    with open("/dev/full", "w") as full:
        done = subprocess.run([*REPLAY, "--out", str(out)], stdout=full, stderr=subprocess.PIPE,
                              env=_env(unbuffered), timeout=120, text=True)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "tiercache replay: error: cannot write to standard output (No space left on device); what it printed is "
        "incomplete; a results file or report folder it writes was written before it printed"]
    assert len(json.loads(out.read_text())["runs"]) == 4


def test_a_closed_standard_output_is_no_traceback(tmp_path):
    out = tmp_path / "r.json"
    command = " ".join(shlex.quote(a) for a in [*REPLAY, "--out", str(out)])
    done = subprocess.run(f"{command} >&-", shell=True, stderr=subprocess.PIPE, timeout=120, text=True)
    assert done.returncode == 0 and done.stderr == ""
    assert len(json.loads(out.read_text())["runs"]) == 4
