"""Probe q49 (the analysis and demo scripts): a disaggregation hand-off that fetched nothing
(its publisher or the master gone) is no hand-off, not a 0.3x "speed-up" passing a KV check
that compared nothing; gap_closed and policy_zoo read every trace (and refuse a step trace)
before the first table; gap_closed's 3-tier rows take the middle of the sorted capacities;
policy_zoo does not run libCacheSim policies below the size their sizing needs (S3-FIFO
aborted the process below 10 blocks)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from test_script_bench_honesty import _script

DATA = Path(__file__).parent / "data"
HEAD = str(DATA / "mooncake_head.jsonl")


def _handoff(remote_gets: int, cached_tokens: int) -> dict:
    return {"found_tokens": 512, "cached_tokens": cached_tokens, "tokens": [1, 2], "fetch_s": 0.01, "rebuild_s": 0.0,
            "tail_s": 0.02, "ttft_s": 0.03, "bytes_fetched": remote_gets, "remote_gets": remote_gets,
            "exists_calls": 1, "kv_max_abs_diff": 0.0}


@pytest.mark.parametrize("fetched", [0, 7])
def test_a_hand_off_that_fetched_fewer_blocks_than_the_prompt_has_is_refused(capsys, fetched):
    demo = _script("disagg_demo")
    recomputes = [{"tokens": [1, 2], "ttft_s": 0.01}] * 2
    consumed = demo.summarise([_handoff(8, 512), _handoff(fetched, fetched * 64)], recomputes, demo.handed_off_blocks(520))
    assert not consumed["fetched_all"] and consumed["ttft_speedup"] is None
    produced = {"prefill_s": 0.1, "blocks": 8, "published": 8, "bytes_put": 8, "store_s": 0.01, "copies": 3}
    args = SimpleNamespace(tokens=520, new_tokens=2, json=None)
    assert demo.report(produced, consumed, args) == 1
    assert f"a hand-off fetched {fetched} of the 8 blocks a hand-off uses" in capsys.readouterr().err
    assert demo.summarise([_handoff(8, 512)] * 2, recomputes, 8)["ttft_speedup"] == pytest.approx(1 / 3)


def test_gap_closed_reads_every_trace_before_its_first_table(tmp_path, capsys):
    steps = tmp_path / "steps.jsonl"
    steps.write_text('{"step": 0, "layer": 0, "read": [], "write": [1]}\n{"step": 1, "layer": 0, "read": [1], "write": []}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n{"timestamp": 1, "hash_ids": [1\n')
    gap_closed = _script("gap_closed")
    for trace, message in ((steps, "a step trace"), (bad, "bad.jsonl:2:")):
        with pytest.raises(SystemExit) as exc:
            gap_closed.main(["--trace", HEAD, "--capacity", "100", "--trace", str(trace), "--capacity", "4"])
        assert exc.value.code == 2
        out, err = capsys.readouterr()
        assert out == "" and message in err
    with pytest.raises(SystemExit):
        gap_closed.main(["--trace", HEAD, "--capacity", "100", "--policy", "lru,belady"])
    assert "no policy to compare" in capsys.readouterr().err
    assert gap_closed.three_tiers([40, 10, 20]) == (5, 20, 80)


def test_policy_zoo_runs_no_libcachesim_policy_below_the_size_it_needs():
    pytest.importorskip("libcachesim")
    zoo = _script("policy_zoo")
    assert not zoo.runs_at("S3FIFO", 9) and zoo.runs_at("S3FIFO", 20) and zoo.runs_at("LRU", 1)
    from tiercache.sim.loader import load_trace

    misses = zoo.libcachesim_misses(load_trace(HEAD), [9])  # S3-FIFO at 9 blocks aborted the process
    assert ("S3FIFO", 9) not in misses and ("WTinyLFU", 9) not in misses and ("LIRS", 9) in misses


def test_belady_gap_replays_a_capacity_given_twice_once():
    args = _script("belady_gap").parse_args([HEAD, "--capacity", "100,100,50"])
    assert args.capacity == [100, 50]
