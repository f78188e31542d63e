"""kv-cache-tester traces: one JSON file per conversation, a file or a folder as one workload."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tiercache.errors import TraceError
from tiercache.sim.loader import load_trace
from tiercache.sim.replay import ReplayData
from tiercache.sim.tracestats import trace_stats

SAMPLE = Path(__file__).parent / "data" / "kvtester_sample"


def _conv(path: Path, requests: list[dict], **extra) -> Path:
    path.write_text(json.dumps({"block_size": 64, "requests": requests, **extra}))
    return path


def _req(t: float, ids: list[int]) -> dict:
    return {"t": t, "in": 64 * len(ids), "out": 10, "hash_ids": ids, "type": "chat"}


def test_sample_folder_is_one_workload_with_its_block_size() -> None:
    trace = load_trace(SAMPLE)
    files = sorted(SAMPLE.glob("*.json"))
    assert trace.records == sum(len(json.loads(f.read_text())["requests"]) for f in files)
    assert trace.block_tokens == 64
    assert np.all(np.diff(trace.requests.timestamps) >= 0)
    assert ReplayData.prepare(trace, None, None).block_tokens == 64  # the cost model sees 64 tokens


def test_local_ids_are_unique_per_conversation_and_global_ids_shared(tmp_path: Path) -> None:
    _conv(tmp_path / "a.json", [_req(0, [0, 1]), _req(5, [0, 1, 2])], start=0)
    _conv(tmp_path / "b.json", [_req(0, [0, 1])], start=1)  # same local ids, other conversation
    _conv(tmp_path / "c.json", [_req(0, [7, 8])], start=2, hash_id_scope="global")
    _conv(tmp_path / "d.json", [_req(0, [7, 9])], start=3, hash_id_scope="global")
    trace = load_trace(tmp_path)
    per_request = np.split(trace.ids, trace.offsets[1:-1])
    a1, b1, c1, d1, a2 = (r.tolist() for r in per_request)  # arrival order: 0, 1, 2, 3, 5 s
    assert a2[:2] == a1 and not set(a1) & set(b1)
    assert c1 == [7, 8] and d1 == [7, 9]
    assert not set(a1 + b1 + a2) & {7, 8, 9}
    assert trace.requests.timestamps.tolist() == [0, 1000, 2000, 3000, 5000]


def test_poisson_arrivals_are_seeded_and_single_files_load(tmp_path: Path) -> None:
    for name in "ab":
        _conv(tmp_path / f"{name}.json", [_req(0, [0]), _req(1.5, [0, 1])])
    first, second = load_trace(tmp_path), load_trace(tmp_path)
    assert first.requests.timestamps.tolist() == second.requests.timestamps.tolist()
    assert first.fingerprint == second.fingerprint
    single = load_trace(tmp_path / "a.json")
    assert single.records == 2 and single.requests.timestamps.tolist() == [0, 1500]


@pytest.mark.parametrize(("content", "message"), [
    ({"requests": [_req(0, [0])]}, "block_size"),
    ({"block_size": 64, "requests": []}, "requests must be a non-empty list"),
    ({"block_size": 64, "requests": [_req(2, [0]), _req(1, [0])]}, "goes back in time"),
    ({"block_size": 64, "requests": [{"t": 0, "in": 1, "out": 1, "hash_ids": [-1]}]}, "requests[0]"),
    ({"block_size": 64, "hash_id_scope": "galaxy", "requests": [_req(0, [0])]}, "hash_id_scope"),
])
def test_bad_conversations_name_the_file_and_field(tmp_path: Path, content: dict, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(TraceError, match="bad.json") as info:
        load_trace(tmp_path)
    assert message in str(info.value)


def test_conversations_must_agree_on_block_size(tmp_path: Path) -> None:
    _conv(tmp_path / "a.json", [_req(0, [0])])
    (tmp_path / "b.json").write_text(json.dumps({"block_size": 16, "requests": [_req(0, [0])]}))
    with pytest.raises(TraceError, match="block_size"):
        load_trace(tmp_path)


def test_inspect_shows_the_prefix_tree() -> None:
    stats = trace_stats(SAMPLE)
    assert stats.tree_roots is not None and 1 <= stats.tree_roots <= stats.records
    assert stats.tree_depth_pct["max"] + 1 == stats.record_blocks_pct["max"]
    assert 0 < stats.blocks_accessed_once < 1
    assert stats.reuse_distance_pct["max"] < stats.unique_blocks


def test_reuse_distance_matches_a_plain_count() -> None:
    from tiercache.sim.tracestats import reuse_distances

    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, 15, size=120)
        expected = []
        for t in range(len(ids)):
            previous = [p for p in range(t) if ids[p] == ids[t]]
            if previous:
                expected.append(len(set(ids[previous[-1] + 1 : t].tolist())))
        assert reuse_distances(ids).tolist() == expected


def test_arrival_seed_and_gap_change_poisson_arrivals_only(tmp_path: Path) -> None:
    for name in "abc":
        _conv(tmp_path / f"{name}.json", [_req(0, [0])])
    base = load_trace(tmp_path).requests.timestamps
    other = load_trace(tmp_path, arrival_seed=1).requests.timestamps
    slow = load_trace(tmp_path, mean_gap_s=20.0).requests.timestamps
    assert base[0] == other[0] == slow[0] == 0
    assert base.tolist() != other.tolist() and slow[-1] > base[-1]
