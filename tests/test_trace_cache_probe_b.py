"""probeB findings F2, F3, F4, F6 and F9: the trace cache gives a trace the fingerprint
``load_trace`` gives it (kv-cache-tester input included) and caches only what it parsed; a
step trace that only writes is refused; ``trace inspect`` reuse distances cover the whole
trace; a capacity given twice is replayed once.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tiercache.cli import main
from tiercache.errors import TraceError
from tiercache.results import read_results
from tiercache.sim import tracecache, tracestats
from tiercache.sim.loader import load_trace
from tiercache.sim.tracecache import load_trace_cached
from tiercache.sim.tracestats import reuse_distances, trace_stats


def _requests(path: Path, id_lists: list[list[int]]) -> Path:
    """A Mooncake JSONL trace, one request per id list."""
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 1,
                                        "hash_ids": ids}) + "\n" for t, ids in enumerate(id_lists)))
    return path


def _conversation(path: Path, id_lists: list[list[int]]) -> Path:
    """A kv-cache-tester conversation file (no ``start``: seeded arrivals)."""
    requests = [{"t": float(i), "in": 64 * len(ids), "out": 1, "hash_ids": ids} for i, ids in enumerate(id_lists)]
    path.write_text(json.dumps({"block_size": 64, "requests": requests}))
    return path


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) if cache.exists() else []


def _user_error(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# ----------------------------------------------------------------------------- F2: kv-cache-tester input


def test_a_kvtester_folder_loads_through_the_cache_with_load_traces_fingerprint(tmp_path):
    folder = tmp_path / "convs"
    folder.mkdir()
    _conversation(folder / "a.json", [[0, 1, 2], [0, 1, 2, 3]])
    _conversation(folder / "b.json", [[10, 11], [10, 11, 12]])
    cache = tmp_path / "cache"
    for _ in range(2):
        got, want = load_trace_cached(folder, cache), load_trace(folder)
        assert got.fingerprint == want.fingerprint and np.array_equal(got.ids, want.ids)
        assert got.block_tokens == want.block_tokens == 64
    assert _entries(cache) == []  # a workload is read directly, never cached


def test_a_conversation_file_has_one_fingerprint_whether_cached_or_not(tmp_path):
    path, cache = _conversation(tmp_path / "conv.json", [[0, 1, 2], [0, 1, 2, 3], [7]]), tmp_path / "cache"
    want = load_trace(path)
    miss, hit = load_trace_cached(path, cache), load_trace_cached(path, cache)
    assert miss.fingerprint == hit.fingerprint == want.fingerprint
    assert np.array_equal(hit.ids, want.ids) and hit.block_tokens == want.block_tokens == 64


def test_a_request_trace_hit_carries_load_traces_fingerprint(tmp_path, monkeypatch):
    path, cache = _requests(tmp_path / "t.jsonl", [[1, 2, 3], [1, 2, 4]]), tmp_path / "cache"
    want = load_trace(path)
    load_trace_cached(path, cache)
    assert _entries(cache) == [tracecache._entry_name(want.fingerprint)]

    def no_parse(*args, **kwargs):
        raise AssertionError("the entry should have been read")

    monkeypatch.setattr(tracecache, "load_trace", no_parse)
    hit = load_trace_cached(path, cache)
    assert hit.fingerprint == want.fingerprint and np.array_equal(hit.ids, want.ids)


# ----------------------------------------------------------------------------- F3: the entry holds what was parsed


def test_a_file_rewritten_during_the_parse_is_not_cached_under_its_old_name(tmp_path, monkeypatch):
    path, cache = tmp_path / "t.jsonl", tmp_path / "cache"
    first, second = [[1, 2, 3], [1, 2, 4]], [[7, 8], [9, 9], [7]]
    _requests(path, first)
    real = tracecache.load_trace

    def racing_load(name, *args, **kwargs):  # another writer replaces the file after the digest was taken
        _requests(path, second)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(tracecache, "load_trace", racing_load)
    raced = load_trace_cached(path, cache)
    assert raced.ids.tolist() == [7, 8, 9, 9, 7] and raced.fingerprint == load_trace(path).fingerprint
    monkeypatch.setattr(tracecache, "load_trace", real)
    _requests(path, first)
    again, want = load_trace_cached(path, cache), load_trace(path)
    assert again.ids.tolist() == [1, 2, 3, 1, 2, 4] and again.fingerprint == want.fingerprint
    hit = load_trace_cached(path, cache)
    assert hit.ids.tolist() == [1, 2, 3, 1, 2, 4] and hit.fingerprint == want.fingerprint


def test_an_unreadable_trace_reports_load_traces_error(tmp_path):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(TraceError) as expected:
        load_trace(missing)
    with pytest.raises(TraceError) as got:
        load_trace_cached(missing, tmp_path / "cache")
    assert str(got.value) == str(expected.value)


# ----------------------------------------------------------------------------- F4: a step trace without reads


def test_a_step_trace_that_only_writes_is_refused(tmp_path, capsys):
    path = tmp_path / "only_writes.jsonl"
    path.write_text('{"block_tokens": 16}\n{"step": 0, "layer": 0, "read": [], "write": [0]}\n'
                    '{"step": 1, "layer": 0, "read": [], "write": [1]}\n')
    with pytest.raises(TraceError, match=r"only_writes.jsonl: the trace has records but no block accesses \(a step "
                                         r"trace's accesses are its reads"):
        load_trace(path)
    for argv in (["replay", path, "--capacity", "2", "--no-progress", "--workers", "1"], ["trace", "inspect", path]):
        assert "no block accesses" in _user_error(capsys, *argv)


def test_a_step_trace_with_one_read_still_loads(tmp_path):
    path = tmp_path / "one_read.jsonl"
    path.write_text('{"step": 0, "layer": 0, "read": [], "write": [0]}\n{"step": 1, "layer": 0, "read": [0], "write": []}\n')
    assert trace_stats(path).accesses == 1


# ----------------------------------------------------------------------------- F6: reuse distances, whole trace


def _naive_distances(ids: list[int], is_read: list[bool]) -> list[int]:
    """Distinct ids touched strictly between each read re-touch and the id's previous touch."""
    out, last = [], {}
    for t, block in enumerate(ids):
        if block in last and is_read[t]:
            out.append(len(set(ids[last[block] + 1:t])))
        last[block] = t
    return out


def test_reuse_distances_cover_the_whole_trace(tmp_path, monkeypatch):
    # A cap on the accesses measured (the old REUSE_DISTANCE_LIMIT) would drop every reuse here.
    monkeypatch.setattr(tracestats, "REUSE_DISTANCE_LIMIT", 6, raising=False)
    path = _requests(tmp_path / "t.jsonl", [[0, 1, 2], [3, 4, 5], [0, 1], [5, 0]])
    ids = [0, 1, 2, 3, 4, 5, 0, 1, 5, 0]
    assert _naive_distances(ids, [True] * len(ids)) == [5, 5, 2, 2]  # all after the first 6 accesses
    assert reuse_distances(np.array(ids, dtype=np.int64)).tolist() == [5, 5, 2, 2]
    assert trace_stats(path).reuse_distance_pct == {"p50": 3.5, "p90": 5.0, "p99": 5.0, "max": 5.0}


def test_step_reuse_distances_count_writes_as_touches(tmp_path):
    rng = np.random.default_rng(3)
    records, ids, is_read = [], [], []
    for step in range(40):
        reads = sorted({int(x) for x in rng.integers(0, 12, size=3)})
        write = [100 + step] if step % 3 == 0 else []
        records.append(json.dumps({"step": step, "layer": 0, "read": reads, "write": write}))
        ids += reads + write
        is_read += [True] * len(reads) + [False] * len(write)
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(records) + "\n")
    want = np.array(_naive_distances(ids, is_read))
    got = trace_stats(path).reuse_distance_pct
    assert got["max"] == want.max() and got["p50"] == pytest.approx(float(np.percentile(want, 50)))


# ----------------------------------------------------------------------------- F9: repeated capacities


def test_a_capacity_given_twice_is_replayed_once(tmp_path, capsys):
    path = _requests(tmp_path / "t.jsonl", [[1, 2, 3], [1, 2, 4], [5, 1, 2]])
    out = tmp_path / "r.json"
    assert main(["replay", str(path), "--policy", "lru,LRU,belady", "--capacity", "2,2,0.002k,3,2", "--no-progress",
                 "--workers", "1", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    runs = read_results(out).runs
    assert sorted((r.policy, r.capacity_blocks) for r in runs) == [("belady", 2), ("belady", 3), ("lru", 2), ("lru", 3)]
    assert [r.capacity_blocks for r in runs if r.policy == "lru"] == [2, 3]  # first-seen order
    assert len([line for line in table.splitlines() if line.startswith("lru ")]) == 2


def test_compare_replays_a_repeated_capacity_once(tmp_path, capsys):
    path = _requests(tmp_path / "t.jsonl", [[1, 2, 3], [1, 2, 4], [5, 1, 2]])
    out = tmp_path / "report"
    assert main(["compare", str(path), "--policy", "lru", "--capacity", "3,0.003k,3", "--no-progress",
                 "--workers", "1", "-o", str(out)]) == 0
    capsys.readouterr()
    assert [r.capacity_blocks for r in read_results(out / "results.json").runs] == [3]
