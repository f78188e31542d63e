"""The benchmarks' figures mean what their labels say: cold reads start out of the page
cache, CUDA work is waited for before a timer is read, the long-context peak RSS excludes
the float64 checker, and its overlap figure is a median with the shared balance verdict."""

from __future__ import annotations

import importlib.util
import os
import re
import time
from pathlib import Path

import pytest
import torch

from tiercache import TieredKVCache
from tiercache.bench import decode as bdecode
from tiercache.bench import measure
from tiercache.bench.tiers import QUICK_LAYOUT, BenchConfig
from tiercache.config import KVLayout, TierConfig

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench(tmp_path, blocks: int = 4, reps: int = 1) -> measure.Bench:
    return measure.Bench(BenchConfig(QUICK_LAYOUT, blocks, 2, reps, str(tmp_path), True, 0))


# ----- finding 1: cold reads are cold ---------------------------------------------------


def test_evict_from_page_cache_drops_freshly_written_dirty_files(tmp_path):
    path = tmp_path / "dirty.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20))  # buffered, never fsynced: dirty pages
    assert bdecode.cached_bytes_in([str(path)]) > 0
    assert bdecode.evict_from_page_cache([str(path), str(tmp_path / "gone.bin")]) == 0
    assert bdecode.cached_bytes_of(str(tmp_path)) == 0


def test_zarr_cold_read_starts_with_its_files_out_of_the_page_cache(tmp_path, monkeypatch):
    bench = _bench(tmp_path)
    zarr_dir = str(tmp_path / "zarr_api")
    cached_at_start = []
    timed = measure.Bench._timed

    def probing(self, work, device_work):
        cached_at_start.append(bdecode.cached_bytes_of(zarr_dir))
        return timed(self, work, device_work)

    monkeypatch.setattr(measure.Bench, "_timed", probing)
    try:
        result = bench.zarr_api()
    finally:
        bench.close()
    assert len(cached_at_start) == 2 and cached_at_start[1] == 0  # [write, read]
    assert result["read_cold"] > 0 and result["cold_check"].startswith("verified cold")


def test_zarr_cold_read_is_refused_when_the_files_stay_cached(tmp_path, monkeypatch):
    bench = _bench(tmp_path)
    monkeypatch.setattr(measure, "evict_from_page_cache", lambda paths: 4096)
    try:
        result = bench.zarr_api()
    finally:
        bench.close()
    assert result["read_cold"] is None and result["write"] > 0
    assert result["cold_check"].startswith("NOT cold: 4096 of") and "read not timed" in result["cold_check"]


def test_compared_cold_reads_are_verified_and_a_residue_is_flagged(tmp_path, monkeypatch):
    bench = _bench(tmp_path)
    try:
        bench.repeat()
        bench.latencies()
        clean = bench.machine()
        monkeypatch.setattr(measure, "evict_from_page_cache", lambda paths: 8192)
        bench.repeat()
        flagged = bench.machine()
    finally:
        bench.close()
    assert clean["cold_read_check"].startswith("verified cold") and "WARNING" not in clean["baselines"]["disk_read_cold"]
    assert flagged["cold_read_check"].startswith("NOT cold: 8192")
    assert "WARNING: NOT cold: 8192" in flagged["baselines"]["disk_read_cold"]


# ----- finding 4: CUDA is synchronised before every timer read ---------------------------


def test_the_cuda_stopwatch_synchronises_before_every_read_and_the_cpu_one_never(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    cuda = torch.device("cuda", 0)
    now = bdecode._stopwatch(cuda)
    now(), now()
    assert calls == [cuda, cuda]
    calls.clear()
    assert bdecode._stopwatch(torch.device("cpu")) is time.perf_counter and not calls


def _small_sequence(tmp_path):
    layout = KVLayout(1, 2, 16, "float16", 16, per_layer=True, name="tiny")
    cache = TieredKVCache(layout, [TierConfig("hbm", 2), TierConfig("dram", 2), TierConfig("nvme", 32)],
                          path=tmp_path / "nvme", device="cpu", prefetch="none", window_blocks=2, depth=2, write_through=True)
    kv = bdecode.NeedleKV(12 * 16, 2, 16, 16, 2, 0)
    seq = cache.sequence()
    seq.append(0, *kv.chunk(0, kv.n_blocks * 16))
    return cache, seq, kv


def test_step_timings_reads_every_timer_through_the_device_stopwatch(tmp_path, monkeypatch):
    reads, devices = [], []

    def fake_stopwatch(device):
        devices.append(device)

        def now():
            reads.append(len(reads))
            return float(len(reads))

        return now

    monkeypatch.setattr(bdecode, "_stopwatch", fake_stopwatch)
    cache, seq, kv = _small_sequence(tmp_path)
    with cache:
        q, _ = kv.query(0, 4)
        timing = bdecode.step_timings(seq, 0, q, repeats=2)
    assert devices == [cache.device] and len(reads) == 2 * 6  # start and end of three regions, per repeat
    assert timing["io_only_seconds"] == timing["compute_only_seconds"] == timing["pipelined_seconds"] == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_timings_on_cuda_waits_for_the_kernels(tmp_path, monkeypatch):
    synced = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: (synced.append(device), real(device)))
    layout = KVLayout(1, 2, 16, "float16", 16, per_layer=True, name="tiny")
    with TieredKVCache(layout, [TierConfig("hbm", 2), TierConfig("dram", 2), TierConfig("nvme", 32)], path=tmp_path / "nvme",
                       prefetch="none", window_blocks=2, depth=2, write_through=True) as cache:
        kv = bdecode.NeedleKV(12 * 16, 2, 16, 16, 2, 0)
        seq = cache.sequence()
        seq.append(0, *kv.chunk(0, kv.n_blocks * 16))
        q, _ = kv.query(0, 4)
        assert cache.device.type == "cuda"
        bdecode.step_timings(seq, 0, q.to(cache.device), repeats=1)
    assert synced.count(cache.device) >= 6  # at least one wait per timer read


# ----- findings 5 and 6: long_context's peak RSS and overlap figure ----------------------

_TINY = ["--tokens", "4096", "--block-tokens", "256", "--hbm", "2", "--dram", "2", "--steps", "2", "--exact-steps", "2",
         "--reference-steps", "1", "--needles", "2", "--window-blocks", "2", "--depth", "2", "--no-progress", "--threads", "1"]


def test_long_context_peak_rss_is_taken_before_the_float64_check(tmp_path, monkeypatch):
    lc = _script("long_context")
    checked = []
    real = lc.reference_attention
    monkeypatch.setattr(lc, "reference_attention", lambda *a, **k: (checked.append(1), real(*a, **k))[1])
    monkeypatch.setattr(lc, "rss_peak_bytes", lambda: 999 if checked else 100)  # the check "raises" the peak
    figures = lc.run(lc.parse_args(_TINY + ["--path", str(tmp_path), "--timing-repeats", "1"]))
    assert checked and figures["exact_max_rel_err"] is not None and figures["exact_max_rel_err"] < 1e-2
    assert figures["rss_peak_bytes"] == 100 and figures["rss_peak_with_reference_bytes"] == 999


def test_long_context_overlap_is_a_median_of_three_with_the_shared_verdict(tmp_path, monkeypatch, capsys):
    lc, bench_decode = _script("long_context"), _script("bench_decode")
    assert lc.balance_verdict is bdecode.balance_verdict is bench_decode.balance_verdict  # shared, not copied
    args = lc.parse_args(_TINY + ["--path", str(tmp_path)])
    assert args.timing_repeats >= 3
    repeats = []
    real = lc.step_timings
    monkeypatch.setattr(lc, "step_timings", lambda *a, **k: (repeats.append(k["repeats"]), real(*a, **k))[1])
    figures = lc.run(args)
    lc.print_table(figures)
    out = capsys.readouterr().out
    ratio = figures["io_compute_ratio"]
    assert repeats == [3] and figures["timing_repeats"] == 3
    assert re.search(rf"^io/compute +{ratio:.2f} \({re.escape(bdecode.balance_verdict(ratio))}\)$", out, re.M)
    assert "median of 3" in out and "before the float64 check" in out


def test_long_context_refuses_zero_timing_repeats(capsys):
    lc = _script("long_context")
    with pytest.raises(SystemExit):
        lc.parse_args(_TINY + ["--timing-repeats", "0"])
    assert "--timing-repeats: at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("ratio, balanced", [(0.49, False), (0.5, True), (1.0, True), (2.0, True), (2.01, False)])
def test_balance_verdict_band(ratio, balanced):
    assert bdecode.is_balanced(ratio) is balanced
    assert bdecode.balance_verdict(ratio) == ("balanced" if balanced else "NOT within 2x: the figure says little")


def test_table_names_why_a_zarr_cold_read_was_not_timed(tmp_path, monkeypatch):
    from tiercache.cli.bench import format_table

    from tiercache.bench.tiers import run_bench

    monkeypatch.setattr(measure, "evict_from_page_cache", lambda paths: 4096)
    table = format_table(run_bench(BenchConfig(QUICK_LAYOUT, 4, 1, 1, str(tmp_path), True, 0)))
    assert "cold read not timed (NOT cold: 4096 of" in table and "nan" not in table.lower()
