"""Probe Q80 on the command's standard output: ``replay --out`` printed its tables before it
wrote the results file, so a reader that went away (``| head``, ``| true``) or a full disk
under ``>`` lost the file; a full or closed standard output ended in a traceback."""

from __future__ import annotations

import errno
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tiercache.errors import UserError

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
        "incomplete"]
    assert len(json.loads(out.read_text())["runs"]) == 4


def test_a_closed_standard_output_is_no_traceback(tmp_path):
    out = tmp_path / "r.json"
    command = " ".join(shlex.quote(a) for a in [*REPLAY, "--out", str(out)])
    done = subprocess.run(f"{command} >&-", shell=True, stderr=subprocess.PIPE, timeout=120, text=True)
    assert done.returncode == 0 and done.stderr == ""
    assert len(json.loads(out.read_text())["runs"]) == 4


class _FullDisk:
    """A standard output every write of which fails as a full disk does."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        pass


def test_replay_prints_its_tables_when_the_results_file_cannot_be_written(tmp_path, capsys, monkeypatch):
    """Review R46-1: with --out written first, a file that could not be written lost the
    printed figures too."""
    from tiercache.cli import main, replay

    def refused(path, results, option):
        raise UserError(f"{option} {path}: cannot write (File too large)")

    monkeypatch.setattr(replay, "write_results", refused)
    assert main(["replay", str(TRACE), "--capacity", "50", "--no-progress", "--out", str(tmp_path / "r.json")]) == 2
    captured = capsys.readouterr()
    assert "lru" in captured.out and captured.err.endswith("cannot write (File too large)\n")


def test_bench_writes_its_files_before_it_prints(tmp_path, monkeypatch, capsys):
    """Review R46-2: bench printed its table first, so a full disk under standard output lost
    --json and --save-profile."""
    from tiercache.cli import main

    out, profile = tmp_path / "b.json", tmp_path / "p.json"
    monkeypatch.setattr(sys, "stdout", _FullDisk())
    code = main(["bench", "--quick", "--dir", str(tmp_path), "--json", str(out), "--save-profile", str(profile)])
    err = capsys.readouterr().err
    assert code == 1 and err.endswith("tiercache bench: error: cannot write to standard output (No space left on device); "
                                      "what it printed is incomplete\n")
    assert out.is_file() and (profile.is_file() or "--save-profile" in err)
