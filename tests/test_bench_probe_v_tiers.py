"""Probe V findings 2-4 on ``tiercache bench``: a cold read that was not cold gets no figure
(and no profile), the raw write baseline syncs once per file (the raw limit for the same
durability), and every block a raw write wrote is read back and checked."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tiercache.bench import measure, rawio
from tiercache.bench.tiers import QUICK_LAYOUT, BenchConfig, run_bench, save_measured_profile
from tiercache.bench.verify import BenchError
from tiercache.cli import main
from tiercache.cli.bench import format_table


def _config(tmp_path, blocks: int = 4, threads: int = 2) -> BenchConfig:
    return BenchConfig(QUICK_LAYOUT, blocks, threads, 1, str(tmp_path), False, 0)


def _bench(tmp_path, blocks: int = 4, threads: int = 2) -> measure.Bench:
    return measure.Bench(_config(tmp_path, blocks, threads))


def _stays_cached(monkeypatch, residue: int = 8192) -> None:
    """Every page-cache check finds ``residue`` bytes still cached (as on tmpfs)."""
    monkeypatch.setattr(measure, "evict_from_page_cache", lambda paths: residue)


# ----- finding 2: a read that was not cold is not a cold-read figure -----------------------


def test_cold_read_figures_are_refused_when_the_files_stay_cached(tmp_path, monkeypatch):
    _stays_cached(monkeypatch)
    result = run_bench(_config(tmp_path))
    refused = result["cold_reads_refused"]
    assert "NOT cold: 8192" in refused and str(tmp_path) in refused and "\n" not in refused
    for section in ("ratios", "raw", "tiercache", "ratio_of_medians", "latency_s"):
        assert result[section]["disk_read_cold"] is None, section
    assert result["other_ratios"]["disk_read_cold_vs_one_big_file"] is None and result["disk_read_cold_one_big_file"]["raw"] is None
    assert all("disk_read_cold" not in by_name for by_name in result["samples"].values())
    assert result["ratios"]["disk_write"] > 0 and result["tiercache"]["host_to_device"] > 0  # the other rows stay
    json.dumps(result, allow_nan=False)
    with pytest.raises(ValueError, match="no nvme->dram link"):
        save_measured_profile(result, str(tmp_path / "p.json"))
    assert not (tmp_path / "p.json").exists()


def test_the_table_says_why_in_one_line_instead_of_the_cold_read_rows(tmp_path, monkeypatch):
    _stays_cached(monkeypatch)
    result = run_bench(BenchConfig(QUICK_LAYOUT, 4, 2, 1, str(tmp_path), True, 0))
    table = format_table(result)
    refused = [line for line in table.splitlines() if "refused:" in line]
    assert len(refused) == 1 and refused[0].startswith("NVMe cold block reads") and "NOT cold: 8192" in refused[0]
    assert "big file" not in table and "cold read refused (not cold, above)" in table
    assert "NVMe block writes" in table and "nan" not in table.lower()


def test_a_cached_latency_read_is_refused_too(tmp_path, monkeypatch):
    bench = _bench(tmp_path)
    try:
        bench.repeat()
        assert bench.cold_refusal() is None
        _stays_cached(monkeypatch, 4096)
        bench.latencies()
        assert "NOT cold: 4096" in bench.cold_refusal()
    finally:
        bench.close()


def test_save_profile_is_refused_with_one_line_and_the_rest_is_written(tmp_path, monkeypatch, capsys):
    _stays_cached(monkeypatch)
    out, profile = tmp_path / "b.json", tmp_path / "p.json"
    assert main(["bench", "--quick", "--no-zarr-api", "--dir", str(tmp_path), "--json", str(out), "--save-profile", str(profile)]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and f"--save-profile {profile}: not written" in err and "NOT cold: 8192" in err
    assert not profile.exists() and "refused: " in captured.out
    assert json.loads(out.read_text())["tiercache"]["disk_read_cold"] is None


# ----- finding 3: the raw write limit syncs each file once ---------------------------------


@pytest.mark.parametrize("sync_each_block", [True, False])
def test_raw_writes_sync_per_block_or_once_per_file(tmp_path, monkeypatch, sync_each_block):
    files = rawio.RawBlockFiles(str(tmp_path / "raw"), rawio.PAGE, 2, 8)  # room for every block in either file
    sources = [rawio.source_block(rawio.PAGE, seed) for seed in range(8)]
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd))[1])
    try:
        files.write(sources, list(range(8)), sync_each_block=sync_each_block)
    finally:
        monkeypatch.undo()
        files.close()
    written = {slot % 2 for slot in files.last_slots.tolist()}  # one writer may take every block (a shared queue)
    assert len(synced) == (8 if sync_each_block else len(written))  # per block, or once per file written
    for i, slot in enumerate(files.last_slots.tolist()):  # every block is where last_slots says
        with open(files.paths[slot % 2], "rb") as f:
            f.seek(slot // 2 * rawio.PAGE)
            assert f.read(rawio.PAGE) == bytes(sources[i])


def test_the_bench_raw_write_baseline_is_the_raw_limit_and_says_so(tmp_path, monkeypatch):
    bench = _bench(tmp_path)
    calls = []
    real = rawio.RawBlockFiles.write
    monkeypatch.setattr(rawio.RawBlockFiles, "write", lambda self, *args, **kw: (calls.append(kw), real(self, *args, **kw))[1])
    try:
        bench.first_fill()
        bench.repeat()
        machine = bench.machine()
    finally:
        bench.close()
    assert calls and all(kw.get("sync_each_block") is False for kw in calls)
    assert rawio.RAW_SYNC_POLICY in machine["baselines"]["disk_write"]
    assert rawio.SYNC_POLICY in machine["sync_policy"] and rawio.RAW_SYNC_POLICY in machine["sync_policy"]


# ----- finding 4: every raw write is checked -----------------------------------------------


def test_first_fill_raw_writes_that_write_nothing_are_refused(tmp_path, monkeypatch):
    bench = _bench(tmp_path)
    monkeypatch.setattr(rawio, "_pwrite_all", lambda fd, source, offset: None)  # writes nothing, "succeeds"
    try:
        with pytest.raises(BenchError, match=r"NVMe first-fill writes \(raw\).*no figure is reported"):
            bench.first_fill()
    finally:
        bench.close()


def _skipping_one(real):
    """``_pwrite_all`` that skips its first block only."""
    calls = []

    def pwrite(fd, source, offset):
        calls.append(offset)
        if len(calls) > 1:
            real(fd, source, offset)

    return pwrite


@pytest.mark.parametrize("blocks", [4, 5])  # 5: slices of unequal size
def test_a_steady_state_raw_write_that_skips_one_block_is_refused(tmp_path, monkeypatch, blocks):
    bench = _bench(tmp_path, blocks)  # laid-out slots hold the files' own block, never a benchmark block
    monkeypatch.setattr(rawio, "_pwrite_all", _skipping_one(rawio._pwrite_all))
    try:
        with pytest.raises(BenchError, match=r"NVMe writes \(raw\): 1 of \d+ blocks do not hold"):
            bench.repeat()
    finally:
        bench.close()


def test_an_honest_run_reads_back_every_slot_each_raw_write_wrote(tmp_path, monkeypatch):
    bench = _bench(tmp_path, blocks=5)
    events = []
    write, read = rawio.RawBlockFiles.write, rawio.RawBlockFiles.read

    def spy_write(self, *args, **kw):
        seconds = write(self, *args, **kw)
        events.append(("write", sorted(set(self.last_slots.tolist()))))
        return seconds

    def spy_read(self, slots, dests, threads):
        events.append(("read", sorted(np.asarray(slots).tolist())))
        return read(self, slots, dests, threads)

    monkeypatch.setattr(rawio.RawBlockFiles, "write", spy_write)
    monkeypatch.setattr(rawio.RawBlockFiles, "read", spy_read)
    try:
        bench.first_fill()
        bench.repeat()
    finally:
        bench.close()
    writes = [i for i, (kind, _) in enumerate(events) if kind == "write"]
    assert len(writes) == 4  # two slices, first fill and one repetition
    assert all(events[i + 1] == ("read", events[i][1]) for i in writes)
    fill = [set(events[i][1]) for i in writes[:2]]
    assert not fill[0] & fill[1] and len(fill[0] | fill[1]) == 5  # the first fill only writes new space
