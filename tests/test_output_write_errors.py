"""Output files written whole or not at all (probe B, F5).

A write that fails part-way (a full disk; here a file size limit, RLIMIT_FSIZE with SIGXFSZ
ignored, so the write fails with EFBIG as a full disk fails with ENOSPC) must give a one-line
error naming the output (exit 2, no traceback) and leave an earlier file or report folder as
it was, with no temporary file or folder behind: ``replay --out``, ``compare -o``,
``report -o``, ``report --across -o``, ``bench --json``, ``trace export -o`` and ``trace synth -o``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import signal
from pathlib import Path

import pytest

from conftest import DATA
from tiercache.cli import main
from tiercache.cli.bench import _write_json
from tiercache.errors import UserError
from tiercache.results import read_results, write_results
from tiercache.results.outfile import replace_file
from tiercache.sim.hardware import load_profile, save_profile

TRACE = str(DATA / "mooncake_head.jsonl")
SWEEP = ["--policy", "lru,fifo", "--capacity", "100,200", "--workers", "1", "--no-progress"]


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Writes past ``nbytes`` of any file fail with EFBIG inside the block (SIGXFSZ ignored)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too), by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error_line(capsys, command: str, message: str) -> None:
    err = capsys.readouterr().err
    assert err == f"tiercache {command}: error: {message}\n"


@pytest.fixture(scope="module")
def results_file(tmp_path_factory) -> Path:
    """A replay's results file (the run also compiles or loads the kernels before any limit)."""
    path = tmp_path_factory.mktemp("results") / "results.json"
    assert main(["replay", TRACE, *SWEEP, "--out", str(path)]) == 0
    return path


def test_replay_out_that_fails_part_way_keeps_the_previous_results(tmp_path, results_file, capsys):
    keep = tmp_path / "keep.json"
    keep.write_bytes(results_file.read_bytes())
    assert keep.stat().st_size > 2048
    capsys.readouterr()
    with file_size_limit(2048):
        code = main(["replay", TRACE, *SWEEP, "--out", str(keep)])
    assert code == 2
    one_error_line(capsys, "replay", f"--out {keep}: cannot write: File too large")
    assert keep.read_bytes() == results_file.read_bytes()
    assert os.listdir(tmp_path) == ["keep.json"]  # no temporary file left


def test_write_results_over_a_file_replaces_it_whole(tmp_path, results_file):
    target = tmp_path / "out.json"
    target.write_text("an older file, longer than nothing\n" * 1000)
    write_results(target, read_results(results_file), "--out")
    assert read_results(target) == read_results(results_file)
    assert os.listdir(tmp_path) == ["out.json"]


@pytest.mark.parametrize("command", ["report", "compare"])
def test_report_o_that_fails_part_way_keeps_the_previous_report(tmp_path, results_file, capsys, command):
    out = tmp_path / "rep"
    argv = ["report", str(results_file)] if command == "report" else ["compare", TRACE, *SWEEP]
    assert main([*argv, "-o", str(out)]) == 0
    before = snapshot(tmp_path)
    capsys.readouterr()
    with file_size_limit(4096):  # the PNGs and index.html are larger
        code = main([*argv, "-o", str(out)])
    assert code == 2
    one_error_line(capsys, command, f"-o {out}: cannot write the report: File too large; nothing written")
    assert snapshot(tmp_path) == before  # the previous report whole, no staging folder left


def test_compare_o_that_fails_part_way_leaves_no_folder(tmp_path, results_file, capsys):
    capsys.readouterr()
    with file_size_limit(4096):
        code = main(["compare", TRACE, *SWEEP, "-o", str(tmp_path / "new")])
    assert code == 2
    one_error_line(capsys, "compare", f"-o {tmp_path / 'new'}: cannot write the report: File too large; nothing written")
    assert os.listdir(tmp_path) == []


def test_report_across_that_fails_keeps_the_previous_gaps(tmp_path, results_file, capsys):
    out = tmp_path / "gaps"
    assert main(["report", "--across", str(results_file), "-o", str(out)]) == 0
    before = snapshot(tmp_path)
    assert (out / "gaps.md").stat().st_size > 16
    capsys.readouterr()
    with file_size_limit(16):
        code = main(["report", "--across", str(results_file), "-o", str(out)])
    assert code == 2
    # One error line, after the notes on the rows' n/a gaps (lru,fifo: no belady run; probe q27 F3).
    *notes, error = capsys.readouterr().err.splitlines()
    assert error == f"tiercache report: error: -o {out}: cannot write the report: File too large; nothing written"
    assert all(line.startswith("tiercache report: note: ") for line in notes)
    assert snapshot(tmp_path) == before


def test_bench_json_that_fails_part_way_keeps_the_previous_file(tmp_path):
    target = tmp_path / "bench.json"
    target.write_text(json.dumps({"earlier": "x" * 4096}))
    before = target.read_bytes()
    with file_size_limit(1024), pytest.raises(UserError, match=f"^--json {target}: cannot write: File too large$"):
        _write_json(str(target), {"new": "y" * 4096})
    assert target.read_bytes() == before
    assert os.listdir(tmp_path) == ["bench.json"]


def test_replace_file_on_a_full_disk_keeps_the_target(tmp_path, monkeypatch):
    target = tmp_path / "out.json"
    target.write_text("previous")
    real_write = os.write

    def half_then_full(fd: int, data) -> int:  # as a disk that fills up part-way
        if len(data) > 4:
            return real_write(fd, bytes(data[:4]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(UserError, match="^--out out.json: cannot write: No space left on device$"):
        replace_file(target, "new contents", "--out out.json")
    monkeypatch.undo()
    assert target.read_text() == "previous"
    assert os.listdir(tmp_path) == ["out.json"]


def test_replace_file_keeps_links_and_permissions(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    real.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    replace_file(link, "new", "--out link.json")
    assert link.is_symlink() and real.read_text() == "new"
    assert real.stat().st_mode & 0o777 == 0o640
    replace_file(os.devnull, "discarded", "--out /dev/null")  # not a regular file: written in place
    assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull)


@pytest.mark.parametrize("across", [False, True])
def test_report_o_refuses_the_folder_that_holds_its_input(tmp_path, capsys, across):
    out = tmp_path / "rep"
    assert main(["compare", TRACE, *SWEEP, "-o", str(out)]) == 0
    before = snapshot(tmp_path)
    capsys.readouterr()
    results = str(out / "results.json")
    assert main(["report", *(["--across"] if across else []), results, "-o", str(out)]) == 2
    one_error_line(capsys, "report", f"-o {out}: holds {results}, an input of this command; writing the report "
                                     "replaces the folder and would delete it (give another folder)")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", [
    ["trace", "export", TRACE, "--model", "llama-3-8b"],
    ["trace", "synth", "docs", "--docs", "20", "--blocks", "8", "--requests", "200"],
])
def test_trace_outputs_on_a_full_disk_keep_the_previous_file(tmp_path, capsys, command):
    """``trace export`` wrote its binary trace in place: a full disk left a torn file."""
    target = tmp_path / "out.trace"
    target.write_bytes(b"previous")
    with file_size_limit(1024):
        assert main([*command, "-o", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tiercache trace: error: {target} (") and "cannot write: File too large" in err, err
    assert target.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["out.trace"]


def test_trace_output_into_a_missing_folder_is_named(tmp_path, capsys):
    target = tmp_path / "missing" / "out.trace"
    assert main(["trace", "export", TRACE, "--model", "llama-3-8b", "-o", str(target)]) == 2
    assert f"folder {tmp_path / 'missing'} does not exist" in capsys.readouterr().err


def test_compare_o_refuses_the_folder_that_holds_its_hardware_profile(tmp_path, capsys):
    """The profile (``--hardware FILE``) kept in an earlier report folder was deleted by the new report."""
    out = tmp_path / "rep"
    assert main(["compare", TRACE, *SWEEP, "-o", str(out)]) == 0  # an earlier report, replaced by the next
    profile = out / "profile.json"
    save_profile(load_profile("h200-pcie5-nvme4"), profile)
    before = profile.read_bytes()
    capsys.readouterr()
    assert main(["compare", TRACE, *SWEEP, "--model", "llama-3-8b", "--hardware", str(profile), "-o", str(out)]) == 2
    one_error_line(capsys, "compare", f"-o {out}: holds {profile}, an input of this command; writing the report "
                   "replaces the folder and would delete it (give another folder)")
    assert profile.read_bytes() == before
