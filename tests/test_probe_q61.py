"""Probe Q61: results files and the trace cache.

1. A results file that repeats a key in one object (``"policy": "lru", "policy": "fifo"``,
   or two ``runs`` lists) was read with the last value winning: LRU's counts reported as
   FIFO's, or a whole list of runs dropped, exit 0.
2. A run whose accesses differ from its trace's (a spliced or hand-edited file) was
   reported beside the others: LRU appeared to beat Belady.
3. A multi-worker replay whose shared memory (``/dev/shm``) was full crashed with a traceback.
4. Killed writers' temporary folders stayed in the trace cache for ever, nothing bounded it,
   and an entry written by an older parser was served by a newer one that refuses its trace.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from conftest import DATA
from tiercache.cli import main
from tiercache.errors import ConfigError, UserError
from tiercache.results import read_results
from tiercache.sim import tracecache
from tiercache.sim.sweep import run_sweep
from tiercache.sim.tracecache import load_trace_cached

TRACE = DATA / "mooncake_head.jsonl"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("q61") / "r.json"
    assert main(["replay", str(TRACE), "--policy", "lru,belady", "--capacity", "100", "--out", str(path),
                 "--no-progress"]) == 0
    return json.loads(path.read_text())


def test_a_key_repeated_in_a_results_object_is_refused(results, tmp_path):
    run = json.dumps(results["runs"][0]).replace('"policy": "lru"', '"policy": "lru", "policy": "fifo"', 1)
    head = json.dumps({k: v for k, v in results.items() if k != "runs"})[:-1]
    for name, text in (("policy", f'{head}, "runs": [{run}]}}'),
                       ("runs", f'{head}, "runs": {json.dumps(results["runs"])}, "runs": {json.dumps(results["runs"][:1])}}}')):
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.raises(UserError, match=f"{name}.json: not a results file: the key '{name}' appears twice"):
            read_results(path)


def test_a_run_that_counted_other_accesses_than_its_trace_is_refused(results, tmp_path):
    edited = json.loads(json.dumps(results))
    edited["runs"][0].update(accesses=100, hits=28, misses=72, miss_ratio=0.72, hit_ratio=0.28)
    for tier in edited["runs"][0]["tiers"]:
        tier["hits"] = min(tier["hits"], 28)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(edited))
    with pytest.raises(UserError, match="edited.json: run 1: 100 accesses counted, but the requests trace it "
                                        "replayed holds 7,721"):
        read_results(path)
    (tmp_path / "same.json").write_text(json.dumps(results))
    assert len(read_results(tmp_path / "same.json").runs) == 2


def test_a_replay_without_shared_memory_for_workers_runs_in_one_process(monkeypatch):
    import tiercache.sim.sweep as sweep

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    want = run_sweep(str(TRACE), ["lru", "fifo"], [100], ["object"], workers=1, progress=False)["runs"]
    monkeypatch.setattr(sweep, "ProcessPoolExecutor", no_room)
    with pytest.warns(RuntimeWarning, match=r"worker processes could not start \(\[Errno 28\] No space left"):
        got = run_sweep(str(TRACE), ["lru", "fifo"], [100], ["object"], workers=2, progress=False)["runs"]
    assert [(r["policy"], r["hits"], r["misses"]) for r in got] == [(r["policy"], r["hits"], r["misses"]) for r in want]


def _trace(tmp_path, name: str, lines: int):
    path = tmp_path / name
    path.write_text("".join(TRACE.read_text().splitlines(keepends=True)[:lines]))
    return path


def test_a_write_removes_abandoned_temporary_folders_and_older_entries_of_the_trace(tmp_path):
    cache = tmp_path / "cache"
    trace = _trace(tmp_path, "t.jsonl", 50)
    fingerprint = load_trace_cached(trace, cache).fingerprint
    entry = cache / tracecache._entry_name(fingerprint)
    old, young = cache / ".partial-k1lled_x", cache / ".stale-live1234"
    older_parser = cache / f"{fingerprint}-v5-0000000000000000"
    for folder in (old, young, older_parser):
        folder.mkdir()
        (folder / "ids.npy").write_bytes(b"x" * 100)
    hour_ago = time.time() - tracecache.ABANDONED_S - 60
    os.utime(old, (hour_ago, hour_ago))
    tracecache._discard(entry, cache)  # the next load writes the entry again
    assert load_trace_cached(trace, cache).fingerprint == fingerprint
    assert sorted(p.name for p in cache.iterdir()) == sorted([entry.name, young.name])


def test_a_write_keeps_the_cache_within_its_budget_least_recently_used_first(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    traces = [_trace(tmp_path, f"t{n}.jsonl", 40 + 10 * n) for n in range(3)]
    names = []
    for n, trace in enumerate(traces[:2]):
        names.append(tracecache._entry_name(load_trace_cached(trace, cache).fingerprint))
        stamp = time.time() - 100 + n
        os.utime(cache / names[-1], (stamp, stamp))
    sizes = {name: tracecache._size(cache / name) for name in names}
    assert load_trace_cached(traces[0], cache)  # a hit: t0 is now the most recently used
    monkeypatch.setenv("TIERCACHE_TRACE_CACHE_BYTES", str(sizes[names[0]] * 3))
    names.append(tracecache._entry_name(load_trace_cached(traces[2], cache).fingerprint))
    assert sorted(p.name for p in cache.iterdir()) == sorted([names[0], names[2]])  # t1 went, not t0


def test_an_entry_of_another_parser_is_never_read(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    trace = _trace(tmp_path, "t.jsonl", 30)
    first = load_trace_cached(trace, cache)
    monkeypatch.setattr(tracecache, "_parser_tag", lambda: "feedfacefeedface")  # a changed parser
    parsed = []
    real = tracecache.load_trace
    monkeypatch.setattr(tracecache, "load_trace", lambda name: parsed.append(name) or real(name))
    again = load_trace_cached(trace, cache)
    assert parsed == [str(trace)] and again.fingerprint == first.fingerprint
    assert [p.name for p in cache.iterdir()] == [f"{first.fingerprint}-v{tracecache.VERSION}-feedfacefeedface"]


def test_the_cache_never_touches_what_it_did_not_write(tmp_path, monkeypatch):
    """Review R34: the budget and the abandoned-folder pass took every folder in the cache
    folder for theirs: a cache pointed at a home folder deleted Documents/ and .partial-notes/."""
    home = tmp_path / "home"
    for name in ("Documents", ".partial-notes", ".stale-x", "xxh3-128:not-an-entry"):
        (home / name).mkdir(parents=True)
        (home / name / "file").write_bytes(b"x" * 100_000)
        hours_ago = time.time() - 3 * tracecache.ABANDONED_S
        os.utime(home / name, (hours_ago, hours_ago))
    monkeypatch.setenv("TIERCACHE_TRACE_CACHE_BYTES", "1")
    load_trace_cached(_trace(tmp_path, "t.jsonl", 20), home)
    load_trace_cached(_trace(tmp_path, "u.jsonl", 30), home)  # over budget: only t's entry may go
    theirs = ["Documents", ".partial-notes", ".stale-x", "xxh3-128:not-an-entry"]
    left = {p.name for p in home.iterdir()}
    assert set(theirs) <= left and len(left) == 5  # theirs, and u's entry (t's went for the budget)
    assert all((home / name / "file").exists() for name in theirs)


@pytest.mark.parametrize("value", ["abc", "0x10", "\u00b2", "-5"])
def test_a_budget_that_is_no_byte_size_is_refused_before_anything_is_written(tmp_path, monkeypatch, value):
    """Probe Q80-5: anything but digits was read as the 16 GiB default without a word ('²'
    passed ``isdigit`` and failed ``int``: a traceback)."""
    monkeypatch.setenv("TIERCACHE_TRACE_CACHE_BYTES", value)
    with pytest.raises(ConfigError, match=r"^\$TIERCACHE_TRACE_CACHE_BYTES: "):
        load_trace_cached(_trace(tmp_path, "t.jsonl", 30), tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


@pytest.mark.parametrize("value, budget", [("1GiB", 1 << 30), ("500000", 500000), ("0", 0), ("00", 0), ("0B", 0),
                                           ("", tracecache.DEFAULT_BUDGET_BYTES)])
def test_a_budget_is_a_byte_size_as_capacities_spell_one(monkeypatch, value, budget):
    monkeypatch.setenv("TIERCACHE_TRACE_CACHE_BYTES", value)
    assert tracecache._budget() == budget


def test_a_bad_budget_is_refused_on_a_cache_hit_too(tmp_path, monkeypatch):
    """Review R46-4: it was read only when an entry was written, after the whole parse."""
    trace, cache = _trace(tmp_path, "t.jsonl", 30), tmp_path / "cache"
    load_trace_cached(trace, cache)
    monkeypatch.setenv("TIERCACHE_TRACE_CACHE_BYTES", "bogus")
    with pytest.raises(ConfigError, match=r"^\$TIERCACHE_TRACE_CACHE_BYTES: 'bogus' is not a byte size"):
        load_trace_cached(trace, cache)
