"""Probe Q4 (a README walkthrough): what a user reads from ``--help`` and from a bad option.

- ``tiercache replay --help`` describes the command for a user, not the module's developer
  docstring (RST backticks, ``SweepSpec``, ``spec_from_args``).
- Every script under ``scripts/`` that takes options ends a bad option in one line on stderr
  (``prog: error: ...``, exit 2), as README promises ("ends in one line before any work"),
  through the one shared ``tiercache.bench.script_args.ScriptParser``; ``--help`` still prints
  the whole usage.
- README's ``report --across ... kv.json`` example runs as written: a command before it writes
  ``kv.json``.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tiercache.cli import main

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
#: The scripts that parse options (``bench_tiers.py`` hands its options to ``tiercache bench``).
OPTION_SCRIPTS = sorted(p.name for p in SCRIPTS.glob("*.py") if "add_argument(" in p.read_text(encoding="utf-8"))


#: Each (script, arguments) run below, by one child process (``_RUNNER``): importing torch once
#: instead of once per script keeps these checks to seconds.
CALLS = ([(name, ("--no-such-option",)) for name in OPTION_SCRIPTS]
         + [("long_context.py", ("--mass", "1.5")),
            ("gap_closed.py", ("--trace", "/nonexistent/trace.jsonl", "--capacity", "10")),
            ("gap_closed.py", ("--trace", "/nonexistent/trace.jsonl")),
            ("long_context.py", ("--help",)), ("gap_closed.py", ("--help",))])

#: Runs each script as ``__main__`` with its arguments in a process of its own, forked from
#: this one once it imported what every script imports first (torch, numpy, tiercache): no
#: script sees another's imports or state, and
#: what it writes to file descriptors 1 and 2 (Python's streams or not) is what it printed.
_RUNNER = """
import json, os, runpy, sys, tempfile, traceback
import numpy, torch, tiercache.bench.script_args  # what every script imports first, once
out = []
for path, args in json.loads(sys.argv[1]):
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        pid = os.fork()
        if pid == 0:
            os.dup2(stdout.fileno(), 1)
            os.dup2(stderr.fileno(), 2)
            code = 0
            try:
                sys.argv = [path, *args]
                runpy.run_path(path, run_name="__main__")
            except SystemExit as done:
                code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        stdout.seek(0)
        stderr.seek(0)
        out.append({"code": code, "stdout": stdout.read().decode(), "stderr": stderr.read().decode()})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory) -> dict:
    """(script, arguments) -> what the run gave: exit status, stdout, stderr."""
    calls = [(str(SCRIPTS / name), list(args)) for name, args in CALLS]
    done = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(calls)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path_factory.mktemp("scripts"))
    assert done.returncode == 0, done.stderr[-3000:]
    return {call: SimpleNamespace(returncode=r["code"], stdout=r["stdout"], stderr=r["stderr"])
            for call, r in zip(CALLS, json.loads(done.stdout))}


def test_replay_help_describes_the_command_for_a_user(capsys):
    with pytest.raises(SystemExit) as done:
        main(["replay", "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert "Replays a trace through the tier manager" in shown
    for internal in ("``", "SweepSpec", "spec_from_args", "tiercache.sim", "parsed here"):
        assert internal not in shown, f"replay --help shows {internal!r}:\n{shown}"
    assert shown.startswith("usage: tiercache replay") and "--out OUT" in shown and "policies: lru" in shown


def test_script_parser_errors_are_one_line(capsys):
    from tiercache.bench.script_args import ScriptParser

    parser = ScriptParser(prog="demo.py")
    parser.add_argument("--count", type=int)
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--count", "x"])
    assert done.value.code == 2
    assert capsys.readouterr().err == "demo.py: error: argument --count: invalid int value: 'x'\n"
    with pytest.raises(SystemExit) as done:
        parser.error("first line\n  second line\n")
    assert done.value.code == 2
    assert capsys.readouterr().err == "demo.py: error: first line second line\n"


def test_every_option_script_builds_the_shared_parser():
    assert len(OPTION_SCRIPTS) >= 15, OPTION_SCRIPTS
    for name in OPTION_SCRIPTS:
        text = (SCRIPTS / name).read_text(encoding="utf-8")
        # analysis_parser (scripts/belady_gap.py) builds a ScriptParser for the gap-analysis scripts
        assert ("ScriptParser(" in text or "analysis_parser(" in text) and "ArgumentParser(" not in text, name


@pytest.mark.parametrize("name", OPTION_SCRIPTS)
def test_a_bad_option_of_each_script_ends_in_one_line(name, script_runs):
    done = script_runs[name, ("--no-such-option",)]
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{name}: error: "), done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("name, args, says", [
    ("long_context.py", ["--mass", "1.5"], "argument --mass: expected a share strictly between 0 and 1, got 1.5"),
    ("gap_closed.py", ["--trace", "/nonexistent/trace.jsonl", "--capacity", "10"],
     "--trace /nonexistent/trace.jsonl: no such file or folder"),
    ("gap_closed.py", ["--trace", "/nonexistent/trace.jsonl"], "give one --capacity per --trace"),
])
def test_readme_bad_options_end_in_one_line(name, args, says, script_runs):
    done = script_runs[name, tuple(args)]
    assert done.returncode == 2
    assert done.stderr == f"{name}: error: {says}\n"


@pytest.mark.parametrize("name", ["long_context.py", "gap_closed.py"])
def test_script_help_still_prints_the_whole_usage(name, script_runs):
    done = script_runs[name, ("--help",)]
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith(f"usage: {name} [-h]")
    assert "options:" in done.stdout and "--json" in done.stdout


def _across_example() -> list[str]:
    """The README code block that ends in ``tiercache report --across``, one command a line."""
    blocks, block = [], None
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("```") and block is None:  # an opening fence
            block = []
        elif line.startswith("```"):  # a closing one
            blocks.append(block)
            block = None
        elif block is not None and line.strip():
            block.append(line)
    return next(b for b in blocks if b and b[-1].startswith("tiercache report --across"))


def test_readme_report_across_example_runs_as_written(tmp_path):
    (tmp_path / "tests").symlink_to(ROOT / "tests", target_is_directory=True)
    commands = _across_example()
    assert commands[-1].startswith("tiercache report --across")
    for command in commands:
        words = shlex.split(command)
        assert words[0] == "tiercache", command
        done = subprocess.run([sys.executable, "-m", "tiercache", *words[1:]], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
    gaps = (tmp_path / "gaps" / "gaps.md").read_text(encoding="utf-8")
    rows = [line for line in gaps.splitlines() if line.startswith("| ") and not line.startswith("| trace")]
    traces = {row.split("|")[1].strip() for row in rows}
    assert traces == {"mooncake_synthetic_trace.jsonl#second-half", "kvtester_sample"}, gaps
    assert len(rows) == 6, gaps
