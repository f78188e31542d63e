"""Figures that must mean what their labels say (probe B: F3, F5, F8, F9).

Fleet replays count a trace's own block size, recompute seconds are the prefill time of the
tokens actually recomputed (each request's tokens ``[c, n)``, attention included), every request counts
in its instance, and ``trace inspect`` on a step trace counts reads as accesses, as replay does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiercache.cli import main
from tiercache.config import TierConfig, layout_preset
from tiercache.sim.fleet import FleetSpec, Route, replay_fleet
from tiercache.sim.hardware import load_profile
from tiercache.sim.loader import load_trace
from tiercache.sim.replay import ReplayData, RunSpec, Semantics, replay
from tiercache.sim.tracestats import trace_stats

PROFILE = load_profile("h200-pcie5-nvme4")
RATE = PROFILE.prefill_tokens_per_s
P, PAIR = 8_030_261_248, 4 * 32 * 32 * 128  # llama-3-8b: weights 2 P per token, attention per query-key pair


def _seconds(c: int, n: int) -> float:
    """Prefill of tokens [c, n) of one request (tiercache.sim.prefill), by hand."""
    return (2 * P * (n - c) + PAIR * (n * (n + 1) - c * (c + 1)) / 2) / (RATE * 2 * P)


def _mooncake(tmp_path: Path, requests: list[tuple[list[int], int]]):
    """A Mooncake trace of (hash_ids, input_length) requests (512-token blocks)."""
    path = tmp_path / "mooncake.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": ids}) + "\n"
                            for i, (ids, n) in enumerate(requests)))
    return load_trace(path)


def _bailian(tmp_path: Path, requests: list[list[int]]):
    """A Bailian trace (16-token blocks), each prompt 3 tokens short of its last block."""
    path = tmp_path / "bailian.jsonl"
    path.write_text("".join(json.dumps({"chat_id": i, "parent_chat_id": -1, "timestamp": float(i), "input_length": 16 * len(r) - 3,
                                        "output_length": 7, "type": "text", "turn": 1, "hash_ids": r}) + "\n"
                            for i, r in enumerate(requests)))
    return load_trace(path)


# ----------------------------------------------------------------------------- F3


def test_fleet_counts_the_traces_block_size_not_512_tokens(tmp_path):
    trace = _bailian(tmp_path, [[1, 2, 3], [1, 2, 3, 4]])
    assert trace.block_tokens == 16
    run = replay_fleet(FleetSpec(1, (TierConfig("hbm", 8),), 16), trace, layout_preset("llama-3-8b", 16), profile=PROFILE)
    assert run.hits == 3 and run.prefill_tokens == 45 + 61
    assert run.prefill_tokens_saved == run.instances[0].prefill_tokens_saved == 3 * 16  # not min(3 * 512, 61)
    assert run.instances[0].ttft_saved_s == pytest.approx(_seconds(0, 48), abs=1e-6)  # every hit in HBM: no load


# ----------------------------------------------------------------------------- F5


@pytest.mark.parametrize("policy", ["lru", "belady", "fifo"])
def test_replay_recompute_is_the_prefill_time_of_the_tokens_not_reused(tmp_path, policy):
    trace = _mooncake(tmp_path, [([1, 2], 700), ([1, 2, 3], 1100), ([4], 100)])
    data = ReplayData.prepare(trace, layout_preset("llama-3-8b"), PROFILE)
    run = replay(RunSpec(policy, Semantics.PREFIX, (TierConfig("hbm", 8),)), data)
    assert (run.misses, run.prefill_tokens, run.prefill_tokens_saved) == (4, 1900, 1024)
    # 876 tokens recomputed (676 + 100 + 100), not 4 whole blocks of 512
    recompute = _seconds(0, 700) + _seconds(1024, 1100) + _seconds(0, 100)
    assert run.modeled_seconds["recompute"] == pytest.approx(recompute, abs=1e-6)
    objects = replay(RunSpec(policy, Semantics.OBJECT, (TierConfig("hbm", 8),)), data)
    block = 512 * (512 * 4 / 6 + 513 / 2)  # pairs of a block at the mean read index (0, 1, 0, 1, 2, 0: 4/6)
    per_miss = (2 * P * 512 + PAIR * block) / (RATE * 2 * P)
    assert objects.modeled_seconds["recompute"] == pytest.approx(objects.misses * per_miss, abs=1e-6)  # blocks, not prompts


def test_fleet_recompute_is_the_prefill_time_of_the_tokens_not_reused(tmp_path):
    trace = _mooncake(tmp_path, [([1, 2], 700), ([1, 2, 3], 1100), ([4], 100)])
    run = replay_fleet(FleetSpec(1, (TierConfig("hbm", 8),), 16), trace, layout_preset("llama-3-8b"), profile=PROFILE)
    assert (run.misses, run.prefill_tokens, run.prefill_tokens_saved) == (4, 1900, 1024)
    recompute = _seconds(0, 700) + _seconds(1024, 1100) + _seconds(0, 100)
    assert run.modeled_seconds["recompute"] == pytest.approx(recompute, abs=1e-6)
    assert run.modeled_seconds["total"] == pytest.approx(sum(v for k, v in run.modeled_seconds.items() if k != "total"))


# ----------------------------------------------------------------------------- F9


@pytest.mark.parametrize("route", list(Route))
def test_fleet_counts_requests_without_blocks_in_their_instance(tmp_path, route):
    trace = _mooncake(tmp_path, [([1, 2], 1024), ([], 100), ([1, 3], 1024), ([], 50), ([1], 512)])
    run = replay_fleet(FleetSpec(2, (TierConfig("hbm", 4),), 8, route), trace)
    assert sum(r.requests for r in run.instances) == trace.records == 5
    assert run.accesses == 5


# ----------------------------------------------------------------------------- F8


def _step_trace(tmp_path: Path) -> Path:
    """Writes 0, 1; reads 0, 1 twice; writes 2; reads 2, 0 (6 reads, 3 writes, 3 blocks)."""
    records = [{"step": 0, "layer": 0, "read": [], "write": [0, 1]},
               {"step": 1, "layer": 0, "read": [0, 1], "write": []},
               {"step": 2, "layer": 0, "read": [0, 1], "write": [2]},
               {"step": 3, "layer": 0, "read": [2, 0], "write": []}]
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps({"block_tokens": 16}) + "\n" + "".join(json.dumps(r) + "\n" for r in records))
    return path


def _lru_misses(trace, capacity: int) -> tuple[int, int]:
    run = replay(RunSpec("lru", Semantics.DECODE, (TierConfig("hbm", capacity),)), ReplayData.prepare(trace, None, None))
    return run.accesses, run.misses


def test_inspect_counts_a_step_traces_reads_as_replay_does(tmp_path):
    path = _step_trace(tmp_path)
    stats = trace_stats(path)
    assert (stats.accesses, stats.writes, stats.unique_blocks) == (6, 3, 3)
    assert stats.compulsory_miss_ratio == 0.0  # every block is written before it is read
    assert _lru_misses(load_trace(path), 1000) == (6, 0)  # replay's infinite cache agrees
    assert (stats.blocks_accessed_once, stats.accesses_per_block_mean, stats.accesses_per_block_max) == (1 / 3, 2.0, 3)
    # reads since the previous touch (write or read): 1, 2, 2, 2, 1, 3
    assert stats.reuse_time_pct["max"] == 3 and stats.reuse_time_pct["p50"] == 2
    # distinct blocks touched since the previous touch: 1, 1, 1, 1, 0, 2
    assert stats.reuse_distance_pct["max"] == 2 and stats.reuse_distance_pct["p50"] == 1


@pytest.mark.parametrize("capacity, misses", [(2, 1), (3, 0)])
def test_step_reuse_distances_predict_replay_lru_misses(tmp_path, capacity, misses):
    """An LRU cache of more blocks than a read's reuse distance hits it, as ``TraceStats`` says.
    (Capacities of at least a record's reads: below that the step protocol keeps the record's
    own blocks and refuses its misses, which stack distances do not model.)"""
    assert _lru_misses(load_trace(_step_trace(tmp_path)), capacity) == (6, misses)


def test_inspect_labels_a_step_traces_accesses_as_reads(tmp_path, capsys):
    assert main(["trace", "inspect", str(_step_trace(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "6 reads (3 writes besides: stored, not accessed)" in out
    assert "compulsory miss ratio" in out and "0.00000" in out
