"""A reader that closes the pipe early (``tiercache ... | head``) stops the CLI quietly."""

from __future__ import annotations

import subprocess
import sys

from conftest import DATA

RUN_CLI = "import sys; from tiercache.cli import main; sys.exit(main())"


def run_with_closed_stdout(*argv: str) -> subprocess.CompletedProcess:
    """Runs the CLI with standard output a pipe whose reader is already gone."""
    proc = subprocess.Popen([sys.executable, "-c", RUN_CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, b"", err)


def test_output_into_a_closed_pipe_exits_141_without_a_traceback():
    result = run_with_closed_stdout("trace", "inspect", str(DATA / "mooncake_head.jsonl"))
    assert result.returncode == 141, result.stderr.decode()
    assert result.stderr == b""


def test_a_command_that_prints_nothing_is_not_affected():
    result = run_with_closed_stdout("trace", "inspect", str(DATA / "no-such-trace.jsonl"))
    assert result.returncode == 2
    assert b"Traceback" not in result.stderr and b"no-such-trace.jsonl" in result.stderr
