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
import time
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


def test_export_through_the_cache_writes_the_same_bytes(tmp_path, cache, parses, capsys):
    outs = []
    for i, extra in enumerate(([], [], ["--no-trace-cache"])):  # writes the entry, reads it, reads the file
        outs.append(tmp_path / f"out{i}.bin")
        assert main(["trace", "export", HEAD, "-o", str(outs[-1]), *extra]) == 0
    assert parses == [HEAD, HEAD]  # the second export read the cache
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


def test_a_large_trace_is_announced_on_a_terminal_while_it_is_read(monkeypatch, capsys, cache):
    monkeypatch.setattr(tracefile, "LARGE_TRACE_BYTES", 1)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    trace = tracefile.read_trace(HEAD, progress=True)
    status, _, done = capsys.readouterr().err.partition(tracefile._CLEAR_LINE)
    assert status.startswith(f"tiercache: reading {HEAD} (") and status.endswith(" GiB)...")
    assert done.startswith(f"tiercache: read {len(trace.ids):,} block accesses in ") and done.endswith(" s\n")
    tracefile.read_trace(HEAD, progress=False)
    assert capsys.readouterr().err == ""


def test_no_announcement_off_a_terminal(monkeypatch, capsys, cache):
    monkeypatch.setattr(tracefile, "LARGE_TRACE_BYTES", 1)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    tracefile.read_trace(HEAD, progress=True)
    assert capsys.readouterr().err == ""


def test_a_bad_large_trace_still_gets_a_one_line_error(monkeypatch, capsys, cache, tmp_path):
    """Review R37: the announcement stayed above the error, two lines where one is the rule."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(Path(HEAD).read_text().splitlines(keepends=True)[0] + '{"timestamp": 1, "hash_ids": [1]}\n')
    monkeypatch.setattr(tracefile, "LARGE_TRACE_BYTES", 1)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["replay", str(bad), "--workers", "1"]) == 2
    shown = capsys.readouterr().err.rpartition(tracefile._CLEAR_LINE)[2]  # what the terminal keeps
    assert len(shown.strip().splitlines()) == 1 and f"{bad}:2" in shown


def test_an_empty_home_is_no_home(monkeypatch, tmp_path, parses):
    monkeypatch.delenv("TIERCACHE_TRACE_CACHE")
    monkeypatch.setenv("HOME", "")
    assert tracefile._cache_folder() is None
    tracefile.read_trace(HEAD)
    assert parses == [HEAD]


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


#: A writer of a temporary folder that holds its lock until stdin closes (``_hold``).
_WRITER = """
import sys
from pathlib import Path
from tiercache.sim import tracecache
assert tracecache._hold(Path(sys.argv[1])) is not None
print("held", flush=True)
sys.stdin.read()
"""


def _writer(folder: Path) -> subprocess.Popen:
    """A process that made ``folder`` its temporary folder and holds its lock, as ``_write`` does."""
    folder.mkdir()
    (folder / "ids.npy").write_bytes(b"x" * 1000)
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline() == "held\n"
    return child


def test_a_killed_writers_folder_goes_at_the_next_write_not_an_hour_later(tmp_path):
    """Probe Q76: a killed writer's ``.partial-*`` folder (up to the trace's whole entry) stayed
    for an hour. A writer holds an ``flock`` in its folder now (what a pid would not tell across
    pid namespaces, review R37), so a killed one's goes at the next write; a live writer's
    stays, however old; a folder without the lock keeps the hour."""
    cache = tmp_path / "cache"
    cache.mkdir()
    killed, live = _writer(cache / ".partial-k1lled_x"), _writer(cache / ".partial-wr1ting_")
    killed.kill()
    killed.wait()
    old_style = cache / ".partial-0ldstyle"
    old_style.mkdir()
    hours_ago = time.time() - 3 * tracecache.ABANDONED_S
    os.utime(cache / ".partial-wr1ting_", (hours_ago, hours_ago))
    try:
        tracecache.load_trace_cached(_small_trace(tmp_path, "t.jsonl", 30), cache)
        left = {p.name for p in cache.iterdir() if p.name.startswith(".")}
        assert left == {".partial-wr1ting_", old_style.name}
    finally:
        live.stdin.close()
        live.wait()
    tracecache.load_trace_cached(_small_trace(tmp_path, "u.jsonl", 40), cache)  # its writer is gone now
    assert {p.name for p in cache.iterdir() if p.name.startswith(".")} == {old_style.name}


def test_a_live_writers_folder_does_not_evict_entries(tmp_path, monkeypatch):
    """Review R37: counting live writers' folders against the budget evicted entries the
    budget holds (two commands caching one new trace at once)."""
    cache = tmp_path / "cache"
    first = tracecache.load_trace_cached(_small_trace(tmp_path, "t.jsonl", 30), cache)
    entry = cache / tracecache._entry_name(first.fingerprint)
    live = _writer(cache / ".partial-wr1ting_")
    (cache / ".partial-wr1ting_" / "next_use.npy").write_bytes(b"x" * 100_000)
    try:
        monkeypatch.setenv("TIERCACHE_TRACE_CACHE_BYTES", str(3 * tracecache._size(entry)))
        tracecache.load_trace_cached(_small_trace(tmp_path, "u.jsonl", 40), cache)
        assert entry.exists()
    finally:
        live.stdin.close()
        live.wait()


def test_an_entry_holds_no_writer_lock(tmp_path):
    cache = tmp_path / "cache"
    trace = tracecache.load_trace_cached(_small_trace(tmp_path, "t.jsonl", 30), cache)
    entry = cache / tracecache._entry_name(trace.fingerprint)
    assert sorted(p.name for p in entry.iterdir()) == sorted(f"{key}.npy" for key in (*tracecache._ARRAYS, tracecache._DIGEST))
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]


def test_a_step_trace_is_not_hashed_for_a_cache_lookup(tmp_path, monkeypatch):
    """Review R37: step traces are never cached, yet were hashed whole before their parse."""
    steps = tmp_path / "steps.jsonl"
    assert main(["trace", "synth", "scan", "-o", str(steps), "--steps", "3", "--blocks", "4"]) == 0
    monkeypatch.setattr(tracecache, "_file_fingerprint", lambda name: pytest.fail("hashed for a lookup"))
    trace = tracecache.load_trace_cached(steps, tmp_path / "cache")
    assert trace.steps is not None and trace.fingerprint == loader.load_trace(steps).fingerprint


def test_export_refuses_no_trace_cache_twice(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["trace", "export", HEAD, "-o", str(tmp_path / "o.bin"), "--no-trace-cache", "--no-trace-cache"])
    assert stop.value.code == 2 and "--no-trace-cache" in capsys.readouterr().err


def test_trace_inspect_reads_the_cache_and_prints_the_same(tmp_path, cache, parses, capsys):
    outputs = []
    for extra in ([], [], ["--no-trace-cache"]):  # writes the entry, reads it, reads the file
        assert main(["trace", "inspect", HEAD, "--json", *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert parses == [HEAD, HEAD]  # the second inspect read the cache
    assert outputs[0] == outputs[1] == outputs[2]


def test_cached_next_uses_are_the_parsers(cache):
    from tiercache.sim.traces import next_use

    cached = tracecache.load_trace_cached(HEAD, cache)
    assert np.array_equal(cached.next_use, next_use(loader.load_trace(HEAD).ids))
