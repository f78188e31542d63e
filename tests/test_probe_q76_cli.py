"""Probe Q76 (scale), the commands' side: the CLI never used the binary trace cache, and
``compare`` parsed its trace twice.

``replay``, ``compare``, ``trace export`` and a fleet replay now read a request trace through
the cache (``tiercache.cli.tracefile.read_trace``): the second command on a file parses
nothing, and gives the same results. ``--no-trace-cache`` reads it alone and writes nothing.
``compare`` hands the trace it replayed to the report, whose LRU curve was drawn from a
second parse. A large trace is announced on stderr while it is read (no bar moves then), and
compare's closing line times the replays and the report apart. ``trace export`` counts
distinct blocks without ``np.unique``'s slow path and writes the same bytes either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tiercache.cli import main
from tiercache.cli import tracefile
from tiercache.report import lru_curve
from tiercache.sim import loader, tracecache
from tiercache.sim.oracle import export_trace, read_oracle_general

DATA = Path(__file__).parent / "data"
HEAD = str(DATA / "mooncake_head.jsonl")
QUIET = ["--workers", "1", "--no-progress"]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty trace cache of this test, in the environment as the commands read it."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("TIERCACHE_TRACE_CACHE", str(folder))
    return folder


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """The trace files parsed from JSON (``load_trace`` called on them by the cache or the report)."""
    seen: list[str] = []
    real = loader.load_trace

    def counting(name, *args, **kwargs):
        seen.append(str(name))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(tracecache, "load_trace", counting)
    monkeypatch.setattr(tracefile, "load_trace", counting)
    monkeypatch.setattr(lru_curve, "load_trace", counting)
    return seen


def _entries(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if not p.name.startswith(".")] if folder.is_dir() else []


def _replay(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["replay", HEAD, "--policy", "lru,arc", "--capacity", "50,200", *QUIET, "--out", str(out), *extra]) == 0
    runs = json.loads(out.read_text())["runs"]
    return {(r["policy"], r["capacity_blocks"]): (r["hits"], r["misses"]) for r in runs}


def test_a_second_replay_of_a_file_reads_the_cache_and_gives_the_same_results(tmp_path, cache, parses, capsys):
    first = _replay(tmp_path, "first")
    assert parses == [HEAD] and len(_entries(cache)) == 1
    second = _replay(tmp_path, "second")
    assert parses == [HEAD], "the second replay parsed the trace again"
    assert second == first
    capsys.readouterr()


def test_no_trace_cache_parses_every_time_and_writes_nothing(tmp_path, cache, parses, capsys):
    cached = _replay(tmp_path, "cached")
    plain = [_replay(tmp_path, f"plain{i}", "--no-trace-cache") for i in range(2)]
    assert plain == [cached, cached]
    assert parses == [HEAD] * 3 and len(_entries(cache)) == 1
    capsys.readouterr()


def test_no_trace_cache_on_an_empty_cache_writes_nothing(tmp_path, cache, parses, capsys):
    _replay(tmp_path, "plain", "--no-trace-cache")
    assert not cache.exists() or not _entries(cache)
    capsys.readouterr()


def test_no_trace_cache_is_refused_twice(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["replay", HEAD, "--no-trace-cache", "--no-trace-cache"])
    assert stop.value.code == 2 and "--no-trace-cache" in capsys.readouterr().err


def test_compare_parses_its_trace_once_and_times_the_replays_and_the_report_apart(tmp_path, cache, parses, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    assert main(["compare", HEAD, "--policy", "lru,belady", "--capacity", "50,200", *QUIET, "-o", str(out)]) == 0
    assert parses == [HEAD], "the report's LRU curve parsed the trace again"
    stdout = capsys.readouterr().out
    assert "4 runs: trace read and replayed in " in stdout and " s, report written in " in stdout
    # the curve was drawn from the trace handed over
    assert "computed in one pass from reuse (stack) distances" in (out / "report.md").read_text()


def test_export_through_the_cache_writes_the_same_bytes(tmp_path, cache, capsys):
    outs = []
    for i, extra in enumerate(([], [], ["--no-trace-cache"])):  # writes the entry, reads it, reads the file
        outs.append(tmp_path / f"out{i}.bin")
        assert main(["trace", "export", HEAD, "-o", str(outs[-1]), *extra]) == 0
    lines = [line.rpartition(" to ")[0] for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3 and len(set(lines)) == 1  # the same records and unique blocks each way
    assert outs[0].read_bytes() == outs[1].read_bytes() == outs[2].read_bytes()
    ids = read_oracle_general(str(outs[0]))["obj_id"]
    assert f"{len(np.unique(ids)):,} unique blocks" in lines[0]


def test_export_counts_distinct_blocks_from_a_cached_trace(tmp_path, cache):
    trace = tracecache.load_trace_cached(HEAD, cache)
    assert trace.dense is not None
    plain = loader.load_trace(HEAD)
    got = export_trace(trace, tmp_path / "a.bin")
    assert got == export_trace(plain, tmp_path / "b.bin")
    assert got.unique_blocks == len(np.unique(plain.ids))


def test_a_large_trace_is_announced_while_it_is_read(monkeypatch, capsys, cache):
    monkeypatch.setattr(tracefile, "LARGE_TRACE_BYTES", 1)
    trace = tracefile.read_trace(HEAD, progress=True)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"tiercache: reading {HEAD} (") and err[0].endswith(" GiB)...")
    assert err[1].startswith(f"tiercache: read {len(trace.ids):,} block accesses in ")
    tracefile.read_trace(HEAD, progress=False)
    assert capsys.readouterr().err == ""


def test_without_a_home_directory_the_trace_is_read_without_the_cache(monkeypatch, tmp_path, parses):
    monkeypatch.delenv("TIERCACHE_TRACE_CACHE")
    monkeypatch.chdir(tmp_path)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert len(tracefile.read_trace(HEAD).ids) == len(loader.load_trace(HEAD).ids)
    assert parses == [HEAD] and not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------- the cache's temporary folders


def _small_trace(tmp_path: Path, name: str, requests: int) -> Path:
    path = tmp_path / name
    path.write_text("".join(f'{{"timestamp": {i}, "input_length": 1024, "output_length": 1, "hash_ids": [{i}, {i + 1}]}}\n'
                            for i in range(requests)))
    return path


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_writers_folder_goes_at_the_next_write_not_an_hour_later(tmp_path):
    """Probe Q76: a killed writer's ``.partial-*`` folder (up to the trace's whole entry) stayed
    outside the size budget for an hour. Named with its writer's pid now, it goes as soon as
    that process is gone; a live process's stays, an old-style name keeps the hour."""
    cache = tmp_path / "cache"
    cache.mkdir()
    dead, live, old_style = (cache / f".partial-{_dead_pid()}-k1lled_x", cache / f".partial-{os.getppid()}-wr1ting_",
                             cache / ".partial-0ldstyle")
    for folder in (dead, live, old_style):
        folder.mkdir()
        (folder / "ids.npy").write_bytes(b"x" * 1000)
    tracecache.load_trace_cached(_small_trace(tmp_path, "t.jsonl", 30), cache)
    left = {p.name for p in cache.iterdir() if p.name.startswith(".")}
    assert left == {live.name, old_style.name}


def test_a_live_writers_folder_counts_against_the_budget(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = tracecache.load_trace_cached(_small_trace(tmp_path, "t.jsonl", 30), cache)
    entry = cache / tracecache._entry_name(first.fingerprint)
    live = cache / f".partial-{os.getppid()}-wr1ting_"
    live.mkdir()
    (live / "ids.npy").write_bytes(b"x" * 10_000)
    second = _small_trace(tmp_path, "u.jsonl", 40)
    # room for both entries, not for both and the live writer's bytes: the older entry goes
    monkeypatch.setenv("TIERCACHE_TRACE_CACHE_BYTES", str(2 * tracecache._size(entry) + 5_000))
    tracecache.load_trace_cached(second, cache)
    assert not entry.exists() and live.exists()


def test_new_temporary_folders_carry_the_writers_pid(tmp_path):
    made = tracecache._temporary(tmp_path, "partial")
    match = tracecache._TEMPORARY.fullmatch(made.name)
    assert match and int(match["pid"]) == os.getpid()
    assert not tracecache._abandoned(match, 0.0)
    assert tracecache._abandoned(match, tracecache.ABANDONED_S + 1)
    for foreign in (".partial-notes", ".partial-12345678-abcdefgh", ".partial-12-abc"):
        assert tracecache._TEMPORARY.fullmatch(foreign) is None
