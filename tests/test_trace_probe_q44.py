"""Probe q44 of ``tiercache trace synth`` / ``export``: a folder's skipped entries are named,
SIGTERM leaves no temporary file, errors place themselves in the line, an export fed back to
``replay`` says what it is, a ``resident`` record may leave read/write out, a rate the
millisecond timestamps cannot show is warned about."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import DATA
from tiercache.cli import main

HEAD = DATA / "mooncake_head.jsonl"


def test_export_of_a_workload_folder_names_the_entries_it_skips(tmp_path, capsys):
    folder = tmp_path / "kv"
    shutil.copytree(DATA / "kvtester_sample", folder)
    (folder / "sub").mkdir()
    (folder / "notes.txt").write_text("hi")
    assert main(["trace", "export", str(folder), "-o", str(tmp_path / "kv.og")]) == 0
    assert "2 entries not read" in capsys.readouterr().err


def test_sigterm_leaves_the_output_as_it_was_and_no_temporary_file(tmp_path):
    out = tmp_path / "big.jsonl"
    out.write_text("old\n")
    child = subprocess.Popen([sys.executable, "-m", "tiercache", "trace", "synth", "sparse", "-o", str(out),
                              "--steps", "3000000", "--blocks", "50"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".partial") for p in tmp_path.iterdir()):  # writing has begun
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()
        time.sleep(0.02)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 143
    assert [p.name for p in tmp_path.iterdir()] == ["big.jsonl"] and out.read_text() == "old\n"


def test_a_malformed_line_is_placed_by_column_not_by_the_decoders_line(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(HEAD.read_text().splitlines()[0] + '\n{"timestamp": 1, x}\n')
    assert main(["trace", "inspect", str(trace)]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:2: malformed JSON:" in err and "at column 18" in err and "line 2 column" not in err


def test_an_empty_output_name_is_refused_naming_the_option(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["trace", "export", str(HEAD), "-o", ""])
    assert done.value.code == 2
    assert "-o: empty value" in capsys.readouterr().err


def test_replaying_an_export_says_it_is_one(tmp_path, capsys):
    exported = tmp_path / "head.og"
    assert main(["trace", "export", str(HEAD), "-o", str(exported)]) == 0
    assert main(["replay", str(exported), "--capacity", "10"]) == 2
    assert "oracleGeneral file" in capsys.readouterr().err


def test_a_resident_record_may_leave_read_and_write_out(tmp_path, capsys):
    trace = tmp_path / "steps.jsonl"
    trace.write_text('{"step":0,"layer":0,"resident":{"nvme":[7]}}\n{"step":1,"layer":0,"read":[7],"write":[]}\n')
    assert main(["replay", str(trace), "--tiers", "hbm=2,nvme=8", "--no-progress"]) == 0
    assert "hbm=0 nvme=1" in capsys.readouterr().out


def test_a_rate_beyond_millisecond_timestamps_is_warned_about(tmp_path, capsys):
    out = tmp_path / "hi.jsonl"
    assert main(["trace", "synth", "docs", "-o", str(out), "--rate", "1e7", "--requests", "20", "--docs", "5",
                 "--blocks", "2"]) == 0
    assert "timestamps are whole milliseconds" in capsys.readouterr().err


def test_a_line_cut_short_after_non_ascii_text_is_placed_at_its_end(tmp_path, capsys):
    trace = tmp_path / "steps.jsonl"
    trace.write_text('{"step": 0, "layer": 0, "note": "\u00e9\u00e9\u00e9", "read": [], "write": [1\n', encoding="utf-8")
    assert main(["trace", "inspect", str(trace)]) == 2
    assert "at the end of the line" in capsys.readouterr().err
