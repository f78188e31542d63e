"""The benchmark scripts refuse to report figures of work that was not done, or not done
right (probe E): each test makes the system under test wrong (or the arguments bad) and
checks that the script says so and exits non-zero instead of printing a speed."""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tiercache.bench import decode as bdecode
from tiercache.config import Codec
from tiercache.data.codec_base import BlockCodec
from tiercache.live.sequence import Sequence

from test_bench_honesty import _small_sequence as _whole_blocks_sequence

ROOT = Path(__file__).resolve().parents[1]
HEAD_TRACE = ROOT / "tests" / "data" / "mooncake_head.jsonl"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def keep_torch_threads():
    """Scripts set torch's thread count for the whole process: put it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# ----- bench_replay: each side's own counts, checked ---------------------------------------


def _half_trace(tmp_path) -> str:
    lines = HEAD_TRACE.read_text().splitlines(True)
    half = tmp_path / "half.jsonl"
    half.write_text("".join(lines[: len(lines) // 2]))
    return str(half)


def test_bench_replay_rates_use_each_sides_own_count_and_refuse_different_work(tmp_path, monkeypatch, capsys):
    pytest.importorskip("libcachesim")
    br = _script("bench_replay")
    half, real = _half_trace(tmp_path), br.tiercache_run
    monkeypatch.setattr(br, "tiercache_run", lambda trace, policy, capacity, cache_dir: real(half, policy, capacity, cache_dir))
    rows = br.compare_policies(str(HEAD_TRACE), 50, 1)
    lru = rows["lru"]
    assert lru["accesses_libcachesim"] > lru["accesses_tiercache"]  # libCacheSim replayed the whole trace
    assert lru["libcachesim_accesses_per_s"] == pytest.approx(lru["accesses_libcachesim"] / lru["libcachesim_cpu_s"])
    assert lru["miss_ratio_libcachesim"] == pytest.approx(lru["misses_libcachesim"] / lru["accesses_libcachesim"])
    assert all(any("not the same work" in p for p in row["problems"]) for row in rows.values())

    monkeypatch.setattr(br, "warm_up", lambda: None)
    monkeypatch.setattr("sys.argv", ["bench_replay.py", "--trace", str(HEAD_TRACE), "--capacity", "50", "--repeats", "1",
                                     "--json", str(tmp_path / "out.json")])
    assert br.main() == 1
    captured = capsys.readouterr()
    assert "MISMATCH" in captured.out and "not the same work" in captured.err
    assert not (tmp_path / "out.json").exists()


def test_bench_replay_refuses_miss_counts_that_differ_for_an_exact_policy(monkeypatch):
    pytest.importorskip("libcachesim")
    br = _script("bench_replay")
    real = br.tiercache_run

    def one_more_miss(trace, policy, capacity, cache_dir):
        seconds, record = real(trace, policy, capacity, cache_dir)
        return seconds, SimpleNamespace(accesses=record.accesses, misses=record.misses + 1)

    monkeypatch.setattr(br, "tiercache_run", one_more_miss)
    rows = br.compare_policies(str(HEAD_TRACE), 500, 1)
    assert rows["lru"]["problems"] and "must be equal" in rows["lru"]["problems"][0]
    assert rows["lru"]["misses_libcachesim"] == rows["lru"]["misses_tiercache"] - 1  # libCacheSim's own count
    assert rows["lfu"]["problems"] == []  # not compared


def test_bench_replay_counts_check_tolerances():
    br = _script("bench_replay")
    ours, theirs = br.Counts(10_000, 5_000), br.Counts(10_000, 5_002)
    assert br.check_counts("arc", [ours], [theirs]) == []  # 2e-4 apart: within ARC's 3e-4
    assert br.check_counts("arc", [ours], [br.Counts(10_000, 5_004)])  # 4e-4 apart
    assert br.check_counts("sieve", [ours], [theirs])  # exact policy
    assert br.check_counts("lfu", [ours], [theirs]) == []  # not compared
    assert "different counts" in br.check_counts("lru", [ours, br.Counts(9_999, 5_000)], [ours])[0]


# ----- bench_quant: the timed calls' outputs are the measured ones -------------------------


def test_bench_quant_refuses_a_decode_from_that_writes_nothing(monkeypatch, capsys):
    quant = _script("bench_quant")
    monkeypatch.setattr(BlockCodec, "decode_from", lambda self, buf, dtype, out: out)
    assert quant.main(["--layers", "1", "--blocks", "1", "--repeats", "1", "--no-disk"]) == 1
    captured = capsys.readouterr()
    assert "decode_from" in captured.err and "no figures reported" in captured.err and "GB/s" not in captured.out


def test_bench_quant_checks_every_timed_encode_into(monkeypatch):
    quant = _script("bench_quant")
    real = BlockCodec.encode_into
    monkeypatch.setattr(BlockCodec, "encode_into", lambda self, block, buf: real(self, block, buf).zero_())
    block = torch.randn(1, 2, 8, quant.TOKENS, quant.DIM).half()
    with pytest.raises(quant.OutputMismatch, match="encode_into"):
        quant.codec_rounds(Codec.INT8, block, rounds=1)


def test_bench_quant_honest_codec_rounds_pass_their_checks():
    quant = _script("bench_quant")
    block = torch.randn(1, 2, 8, quant.TOKENS, quant.DIM).half()
    t = quant.codec_rounds(Codec.INT4, block, rounds=1)
    assert set(t) == {"copy", "both", "encode", "decode", "reference_encode", "reference_decode"}


def test_bench_quant_disk_rounds_check_the_decodes(monkeypatch, tmp_path):
    quant = _script("bench_quant")
    monkeypatch.setattr(BlockCodec, "decode_from", lambda self, buf, dtype, out: out)
    block = torch.randn(1, 2, 8, quant.TOKENS, quant.DIM).half()
    with pytest.raises(quant.OutputMismatch, match="decode_from"):
        quant.disk_rounds(Codec.INT8, block, str(tmp_path), rounds=1, blocks=1)


# ----- step_timings / bench_decode: the pipelined output is checked -----------------------

_DECODE_ARGS = ["--tokens", "4096", "--block-tokens", "256", "--kv-heads", "2", "--head-dim", "16", "--q-heads", "4",
                "--window-blocks", "2", "--depth", "2", "--repeats", "1", "--threads", "1"]


def _small_sequence(tmp_path):
    cache, seq, kv = _whole_blocks_sequence(tmp_path)
    seq.append(0, *kv.decode_kv(0))  # a partial tail block: attend covers it too
    return cache, seq, kv


def _fake_stopwatch(io: float, compute: float, piped: float):
    """A stopwatch whose regions last ``io``, ``compute``, ``piped`` seconds, in that order."""
    def stopwatch(device):
        reads = iter(range(10**6))

        def now() -> float:
            index = next(reads)
            region, end = divmod(index, 2)
            start = sum((io, compute, piped)[r % 3] for r in range(region))
            return start + end * (io, compute, piped)[region % 3]
        return now
    return stopwatch


def test_step_timings_passes_the_real_pipelined_output(tmp_path):
    cache, seq, kv = _small_sequence(tmp_path)
    with cache:
        q, _ = kv.query(0, 4)
        timing = bdecode.step_timings(seq, 0, q, repeats=1)
    assert timing["output_rel_err"] <= bdecode.OUTPUT_RTOL[torch.float32]


def test_step_timings_refuses_an_attend_that_returns_zeros(tmp_path, monkeypatch):
    cache, seq, kv = _small_sequence(tmp_path)
    monkeypatch.setattr(Sequence, "attend", lambda self, layer, q, *a, **k: torch.zeros_like(q, dtype=torch.float32))
    with cache:
        q, _ = kv.query(0, 4)
        with pytest.raises(bdecode.StepCheckError, match="differs"):
            bdecode.step_timings(seq, 0, q, repeats=1)


def test_step_timings_flags_an_efficiency_impossible_by_construction(tmp_path, monkeypatch):
    monkeypatch.setattr(bdecode, "_stopwatch", _fake_stopwatch(1.0, 0.5, 0.1))
    cache, seq, kv = _small_sequence(tmp_path)
    with cache:
        q, _ = kv.query(0, 4)
        timing = bdecode.step_timings(seq, 0, q, repeats=2)
    assert timing["overlap_efficiency"] == pytest.approx(10.0) and timing["plausible"] is False
    assert "cannot beat" in bdecode.overlap_problem(timing)
    assert bdecode.overlap_problem({**timing, "plausible": True}) is None


def test_bench_decode_exits_1_on_a_wrong_or_impossible_pipelined_step(tmp_path, monkeypatch, capsys, keep_torch_threads):
    bench_decode = _script("bench_decode")
    out = tmp_path / "out.json"
    args = _DECODE_ARGS + ["--path", str(tmp_path), "--json", str(out)]
    with monkeypatch.context() as patch:
        patch.setattr(Sequence, "attend", lambda self, layer, q, *a, **k: torch.zeros_like(q, dtype=torch.float32))
        assert bench_decode.main(args) == 1
    assert "differs" in capsys.readouterr().err and not out.exists()
    monkeypatch.setattr(bdecode, "_stopwatch", _fake_stopwatch(1.0, 0.5, 0.1))
    assert bench_decode.main(args) == 1
    assert "cannot beat" in capsys.readouterr().err and not out.exists()


def test_long_context_exits_1_when_the_pipelined_step_is_wrong(monkeypatch, capsys):
    lc = _script("long_context")

    def wrong(args):
        raise bdecode.StepCheckError("the pipelined step's output differs")

    monkeypatch.setattr(lc, "run", wrong)
    assert lc.main(["--tokens", "4096"]) == 1
    assert "differs" in capsys.readouterr().err


# ----- disagg_demo: no speed-up for a hand-off that decodes other tokens -------------------


def _handoff(tokens: list[int]) -> dict:
    return {"found_tokens": 128, "cached_tokens": 128, "tokens": tokens, "fetch_s": 0.01, "rebuild_s": 0.0, "tail_s": 0.01,
            "ttft_s": 0.02, "bytes_fetched": 8, "remote_gets": 2, "exists_calls": 1, "kv_max_abs_diff": 0.0}


def test_disagg_demo_gives_no_speed_up_when_the_hand_off_decodes_other_tokens(tmp_path, capsys):
    demo = _script("disagg_demo")
    consumed = demo.summarise([_handoff([5, 6]), _handoff([5, 6])], [{"tokens": [1, 2], "ttft_s": 0.3}] * 2, 2)
    assert consumed["same_tokens"] is False and consumed["ttft_speedup"] is None
    produced = {"prefill_s": 0.1, "store_s": 0.01, "blocks": 2, "published": 2, "bytes_put": 8, "copies": 3}
    out = tmp_path / "demo.json"
    args = argparse.Namespace(tokens=130, new_tokens=2, json=str(out))
    assert demo.report(produced, consumed, args) == 1
    captured = capsys.readouterr()
    assert "speed-up" not in captured.out and "other tokens" in captured.err and not out.exists()
    honest = demo.summarise([_handoff([1, 2])], [{"tokens": [1, 2], "ttft_s": 0.3}], 2)
    assert demo.report(produced, honest, args) == 0 and json.loads(out.read_text())["decode"]["ttft_speedup"] == pytest.approx(15)
    assert "speed-up (median of per-pair ratios) 15.00x" in capsys.readouterr().out


# ----- bench_memory --speed: one untimed replay per policy first --------------------------


def test_bench_memory_speed_warms_each_policy_up_untimed(monkeypatch):
    memory = _script("bench_memory")
    import tiercache.sim.replay as replay_module

    real, calls = replay_module.replay, {}

    def slow_first(spec, data):
        calls[spec.policy] = calls.get(spec.policy, 0) + 1
        if calls[spec.policy] == 1:  # the first replay of a policy loads its kernel: 0.3 CPU seconds
            started = time.process_time()
            while time.process_time() - started < 0.3:
                pass
        return real(spec, data)

    monkeypatch.setattr(replay_module, "replay", slow_first)
    out = memory.case_speed(1)
    assert calls == {policy: 2 for policy in memory.SPEED_POLICIES}
    assert all(row["cpu_s"] < 0.25 for row in out.values())


# ----- bad sizes: argparse errors before any work ------------------------------------------


@pytest.mark.parametrize("script, argv, message", [
    ("bench_decode", ["--repeats", "0"], "--repeats: expected a positive integer, got 0"),
    ("bench_decode", ["--tokens", "100"], "--tokens: at least one block of --block-tokens 256, got 100"),
    ("bench_decode", ["--q-heads", "3", "--kv-heads", "2"], "--q-heads: a multiple of --kv-heads 2, got 3"),
    ("bench_store", ["--reps", "0"], "--reps: expected a positive integer, got 0"),
    ("bench_store", ["--blocks", "10", "--batch", "4"], "--blocks: a multiple of --batch 4, got 10"),
    ("long_context", ["--steps", "0"], "--steps: expected a positive integer, got 0"),
    ("long_context", ["--exact-steps", "0"], "--exact-steps: expected a positive integer, got 0"),
])
def test_scripts_refuse_bad_sizes_before_any_work(script, argv, message, capsys):
    module = _script(script)
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
