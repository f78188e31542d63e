"""Probe q49: the trace generators (``scripts/gen_kvtester.py``, ``scripts/gen_bailian.py``)
took any option (tracebacks, ``NaN`` in the JSON, "wrote -3 conversations", an empty trace),
wrote their output in place (a failure or Ctrl-C left it partial), and gen_kvtester left an
earlier run's files beside a new run's (two seeds mixed in one folder)."""

from __future__ import annotations

import os
import signal
import sys
import types
from pathlib import Path

import pytest

from test_script_bench_honesty import _script

@pytest.fixture(scope="module")
def kvt():
    return _script("gen_kvtester")


@pytest.fixture(scope="module")
def bailian():
    return _script("gen_bailian")


def _run(module, argv: list[str], monkeypatch) -> int:
    """The script's exit status when run with ``argv`` (in this process)."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    try:
        status = module.main()
    except SystemExit as exit_:
        status = exit_.code
    return status or 0


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (hidden ones too) with a file's bytes (None for a folder)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("script, options", [
    ("kvt", ["--block-size", "0"]),
    ("kvt", ["--block-size", "-64"]),
    ("kvt", ["--turns", "0.5"]),
    ("kvt", ["--gap", "nan"]),
    ("kvt", ["--skew", "nan"]),
    ("kvt", ["--seed", "-1"]),
    ("kvt", ["--prompts", "0"]),
    ("kvt", ["--conversations", "-3"]),
    ("kvt", ["--out", "afile"]),            # an existing file given for the folder
    ("kvt", ["--out", "other"]),            # a folder holding someone else's file
    ("kvt", ["--out", "missing/sub"]),
    ("bailian", ["--conversations", "0"]),
    ("bailian", ["--seed", "-1"]),
    ("bailian", ["--out", "missing/b.jsonl"]),
    ("bailian", ["--out", "other"]),        # a folder given for the file
])
def test_a_bad_option_ends_in_one_error_line_exit_2_before_anything_is_written(
        script, options, request, tmp_path, monkeypatch, capsys) -> None:
    module = request.getfixturevalue(script)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("mine\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine too\n")
    before = _tree(tmp_path)
    default_out = ["--out", "K" if script == "kvt" else "b.jsonl"]
    assert _run(module, [*default_out, "--conversations", "3", *options], monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and options[0] in err, err
    assert _tree(tmp_path) == before


def test_a_rerun_with_fewer_conversations_leaves_exactly_the_new_set(kvt, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "K").mkdir()  # an empty folder is taken
    assert _run(kvt, ["--out", "K", "--conversations", "12", "--seed", "1"], monkeypatch) == 0
    assert len(list((tmp_path / "K").iterdir())) == 12
    assert _run(kvt, ["--out", "K", "--conversations", "4", "--seed", "2"], monkeypatch) == 0
    assert _run(kvt, ["--out", "fresh", "--conversations", "4", "--seed", "2"], monkeypatch) == 0
    assert "wrote 4 conversations" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["K", "fresh"]  # no staging or old folder left beside
    assert _tree(tmp_path / "K") == _tree(tmp_path / "fresh")
    assert sorted(os.listdir(tmp_path / "K")) == [f"conv_{i:05d}.json" for i in range(4)]


@pytest.mark.parametrize("exchange", ["atomic", "unsupported"])
def test_a_rerun_over_earlier_files_swaps_the_names_in_one_step_where_it_can(kvt, exchange, tmp_path, monkeypatch) -> None:
    """A SIGKILL between the two renames of the swap left ``--out`` missing. Where Linux
    offers ``renameat2(RENAME_EXCHANGE)`` the swap is one step (no rename of ``--out`` aside);
    elsewhere the two renames remain, with the same result."""
    monkeypatch.chdir(tmp_path)
    assert _run(kvt, ["--out", "K", "--conversations", "3", "--seed", "1"], monkeypatch) == 0
    if exchange == "unsupported":
        monkeypatch.setattr(kvt, "_renameat2", None)
    renames = []
    real = os.rename
    monkeypatch.setattr(kvt.os, "rename", lambda a, b: renames.append((a, b)) or real(a, b))
    assert _run(kvt, ["--out", "K", "--conversations", "2", "--seed", "2"], monkeypatch) == 0
    assert sorted(os.listdir(tmp_path)) == ["K"] and len(os.listdir(tmp_path / "K")) == 2
    moved_aside = [a for a, _ in renames if os.path.basename(a) == "K"]
    assert len(moved_aside) == (0 if exchange == "atomic" and kvt._renameat2 is not None else 1)


def test_an_out_folder_that_cannot_be_renamed_is_replaced_in_place(kvt, tmp_path, monkeypatch) -> None:
    """A mount point (a Docker volume) cannot be renamed (EBUSY): its files are swapped inside
    it (review r29: every run into one failed)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "K").mkdir()
    (tmp_path / "K" / f".{kvt.STAGING_PREFIX}dead.partial").mkdir()  # left by a killed run
    real = os.path.ismount
    monkeypatch.setattr(kvt.os.path, "ismount", lambda path: path == str(tmp_path / "K") or real(path))
    assert _run(kvt, ["--out", "K", "--conversations", "9", "--seed", "1"], monkeypatch) == 0
    assert _run(kvt, ["--out", "K", "--conversations", "4", "--seed", "2"], monkeypatch) == 0
    assert _run(kvt, ["--out", "fresh", "--conversations", "4", "--seed", "2"], monkeypatch) == 0
    assert sorted(os.listdir(tmp_path / "K")) == [f"conv_{i:05d}.json" for i in range(4)]
    assert _tree(tmp_path / "K") == _tree(tmp_path / "fresh")


def _raising_on_second_call(function, error: BaseException):
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise error
        return function(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()],
                         ids=["disk-full", "ctrl-c"])
def test_a_failure_mid_write_leaves_the_previous_folder_intact(kvt, error, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert _run(kvt, ["--out", "K", "--conversations", "6", "--seed", "1"], monkeypatch) == 0
    before, original = _tree(tmp_path), kvt.conversation
    for out in ("K", "new"):  # over an earlier run, and into a new folder
        monkeypatch.setattr(kvt, "conversation", _raising_on_second_call(original, error))
        argv = ["--out", out, "--conversations", "6", "--seed", "2"]
        if isinstance(error, KeyboardInterrupt):
            assert _run(kvt, argv, monkeypatch) == 130
            assert "interrupted: --out" in capsys.readouterr().err
        else:
            assert _run(kvt, argv, monkeypatch) == 1
            assert "error: --out" in capsys.readouterr().err
        assert _tree(tmp_path) == before  # K as it was; no "new", no staging folder


@pytest.mark.parametrize("error", [ValueError("boom"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_failure_mid_trace_leaves_the_previous_bailian_file_intact(bailian, error, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert _run(bailian, ["--out", "b.jsonl", "--conversations", "5", "--seed", "1"], monkeypatch) == 0
    before = _tree(tmp_path)
    failing = _raising_on_second_call(bailian.json.dumps, error)
    monkeypatch.setattr(bailian, "json", types.SimpleNamespace(dumps=failing))
    if isinstance(error, KeyboardInterrupt):
        assert _run(bailian, ["--out", "b.jsonl", "--conversations", "5", "--seed", "2"], monkeypatch) == 130
    else:
        with pytest.raises(type(error)):
            _run(bailian, ["--out", "b.jsonl", "--conversations", "5", "--seed", "2"], monkeypatch)
    assert _tree(tmp_path) == before


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL,
                    reason="needs SIGTERM's default disposition to start from")
@pytest.mark.parametrize("script", ["kvt", "bailian"])
def test_sigterm_mid_write_exits_143_and_leaves_the_previous_output(script, request, tmp_path, monkeypatch) -> None:
    module = request.getfixturevalue(script)
    monkeypatch.chdir(tmp_path)
    out = "K" if script == "kvt" else "b.jsonl"
    assert _run(module, ["--out", out, "--conversations", "6", "--seed", "1"], monkeypatch) == 0
    before = _tree(tmp_path)
    calls = []

    def terminate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # nothing would catch it: it would end pytest
                raise AssertionError("no SIGTERM handler installed")
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    if script == "kvt":
        original = module.conversation
        monkeypatch.setattr(module, "conversation", terminate)
    else:
        original = module.json.dumps
        monkeypatch.setattr(module, "json", types.SimpleNamespace(dumps=terminate))
    assert _run(module, ["--out", out, "--conversations", "6", "--seed", "2"], monkeypatch) == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back
    assert _tree(tmp_path) == before
