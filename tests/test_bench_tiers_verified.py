"""``tiercache bench`` refuses to print a figure for work that was not done: every timed
transfer is checked against its source, the raw baselines never start threads while timed,
the host copy baseline is a plain memmove, the cold-check message compares pages with
pages, and the output paths are checked before the benchmark runs."""

from __future__ import annotations

import json
import os
import re
import threading

import numpy as np
import pytest
import torch

from tiercache.bench import measure, rawio
from tiercache.bench.decode import cached_bytes_in
from tiercache.bench.tiers import QUICK_LAYOUT, BenchConfig
from tiercache.bench.verify import BenchError
from tiercache.cli import main
from tiercache.cli import bench as cli_bench
from tiercache.data import nvme_read, pools

QUICK = ["bench", "--quick", "--no-zarr-api"]


def _bench(tmp_path, blocks: int = 4, threads: int = 2) -> measure.Bench:
    return measure.Bench(BenchConfig(QUICK_LAYOUT, blocks, threads, 1, str(tmp_path), False, 0))


def _refused(capsys, argv: list[str], where: str, out) -> None:
    """The CLI run ``argv`` exits 1 with one error line naming ``where``, prints no table
    and writes no results."""
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert where in captured.err and "no figure is reported" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "GB/s" not in captured.out and not out.exists()


# ----- every timed transfer is checked ---------------------------------------------------


def test_a_copy_to_that_copies_nothing_gets_no_figure(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pools.BlockPool, "copy_to", lambda self, dst, src, dst_slots, non_blocking=True: None)
    out = tmp_path / "b.json"
    _refused(capsys, [*QUICK, "--dir", str(tmp_path), "--json", str(out)], "DRAM->HBM copies (tiercache)", out)


def test_a_store_get_that_reports_hits_but_reads_nothing_gets_no_figure(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(nvme_read.NVMeReads, "get", lambda self, keys, out: np.ones(len(keys), dtype=bool))
    out = tmp_path / "b.json"
    _refused(capsys, [*QUICK, "--dir", str(tmp_path), "--json", str(out)], "(tiercache)", out)


def _corrupt_one_byte(real):
    def get(self, keys, out):
        hits = real(self, keys, out)
        for block in out:
            block.view(-1).view(torch.uint8)[0] ^= 1
        return hits

    return get


@pytest.mark.parametrize("blocks, wrong_get", [(4, _corrupt_one_byte),  # one byte of each block flipped
                                               (32, lambda real: lambda self, keys, out: real(self, keys[1:] + keys[:1], out))])  # the next key's block
def test_cold_reads_that_deliver_wrong_bytes_are_refused(tmp_path, monkeypatch, blocks, wrong_get):
    bench = _bench(tmp_path, blocks)
    try:
        bench.first_fill()
        monkeypatch.setattr(nvme_read.NVMeReads, "get", wrong_get(nvme_read.NVMeReads.get))
        with pytest.raises(BenchError, match=r"NVMe cold reads \(tiercache\): \d+ of \d+ blocks"):
            bench.repeat()
    finally:
        bench.close()


def test_raw_chunk_reads_that_read_nothing_are_refused(tmp_path, monkeypatch):
    bench = _bench(tmp_path)
    monkeypatch.setattr(rawio, "read_files", lambda paths, dests, tails, pool=None: (1e-3, True))
    try:
        bench.first_fill()
        with pytest.raises(BenchError, match=r"NVMe cold reads \(raw chunk files\)"):
            bench.repeat()
    finally:
        bench.close()


def test_raw_big_file_reads_are_checked_against_what_was_written_there(tmp_path, monkeypatch):
    bench = _bench(tmp_path, blocks=8, threads=1)  # one raw file: every slot is written, half of them read back
    try:
        bench.repeat()  # honest: passes
        make_cold = measure.Bench._make_cold

        def zeroing(self, paths):  # the raw files lose their bytes after the writes were read back and checked
            for path in self.raw.paths:
                with open(path, "r+b") as f:
                    f.write(bytes(os.path.getsize(path)))
            return make_cold(self, paths)

        monkeypatch.setattr(measure.Bench, "_make_cold", zeroing)
        with pytest.raises(BenchError, match=r"NVMe cold reads \(raw big files\)"):
            bench.repeat()
    finally:
        bench.close()


def test_a_raw_host_copy_that_copies_nothing_is_refused(tmp_path, monkeypatch):
    bench = _bench(tmp_path)
    monkeypatch.setattr(rawio, "memmove_copy", lambda *args: 1e-3)
    try:
        with pytest.raises(BenchError, match=r"DRAM->HBM copies \(raw\)"):
            bench.repeat()
    finally:
        bench.close()


def test_a_zarr_read_that_returns_other_bytes_is_refused(tmp_path, monkeypatch):
    import zarr

    bench = _bench(tmp_path)
    real = zarr.Array.__getitem__
    monkeypatch.setattr(zarr.Array, "__getitem__", lambda self, key: np.zeros_like(real(self, key)))
    try:
        with pytest.raises(BenchError, match="zarr API: 4 of 4 blocks read back differ"):
            bench.zarr_api()
    finally:
        bench.close()


def test_read_files_refuses_a_short_read(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    dest = np.frombuffer(rawio.read_buffers(rawio.PAGE, 1)[0], dtype=np.uint8)
    with pytest.raises(OSError, match=r"short read of .*short.bin: 100 bytes, the block needs 4096"):
        rawio.read_files([str(path)], [dest], rawio.read_buffers(rawio.PAGE, 1))


def test_an_honest_run_passes_every_check_and_leaves_dram_as_it_was(tmp_path):
    bench = _bench(tmp_path)
    try:
        reference = measure.pool_rows(bench.dram).clone()
        bench.first_fill()
        samples = bench.repeat()
        bench.latencies()
        assert torch.equal(measure.pool_rows(bench.dram), reference)
    finally:
        bench.close()
    assert all(v > 0 for side in ("tiercache", "raw") for values in samples[side].values() for v in values)


# ----- the raw baselines start no thread while timed ---------------------------------------


def test_raw_baselines_start_no_thread_during_the_timed_repetitions(tmp_path, monkeypatch):
    bench = _bench(tmp_path)
    started = []
    real = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), real(self))[1])
    try:
        bench.first_fill()
        bench.repeat()
    finally:
        monkeypatch.undo()
        bench.close()
    # only the system under test's own pools may grow (the store's I/O, copy_to's copy threads)
    assert [name for name in started if not name.startswith(("tiercache-nvme", "tiercache-copy"))] == []


def test_raw_pool_threads_exist_before_the_first_run_and_are_reused(monkeypatch):
    pool = rawio.RawPool(3)
    started = []
    real = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), real(self))[1])
    seen: set[int] = set()
    try:
        for _ in range(5):
            pool.run(lambda i: seen.add(threading.get_ident()), 3)
    finally:
        pool.close()
    assert started == [] and len(seen) == 3


def test_read_files_uses_the_given_pool(tmp_path, monkeypatch):
    paths = []
    for i in range(4):
        (tmp_path / f"c{i}").write_bytes(os.urandom(rawio.PAGE))
        paths.append(str(tmp_path / f"c{i}"))
    dests = [np.frombuffer(buf, dtype=np.uint8) for buf in rawio.read_buffers(rawio.PAGE, 4)]
    pool = rawio.RawPool(2)
    monkeypatch.setattr(rawio, "RawPool", None)  # a pool made inside the call would fail
    try:
        rawio.read_files(paths, dests, rawio.read_buffers(rawio.PAGE, 2), pool)
    finally:
        pool.close()
    assert all(bytes(dest) == open(p, "rb").read() for dest, p in zip(dests, paths))


# ----- the host copy baseline is a plain memmove -------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the host copy baseline applies without CUDA")
def test_the_raw_host_copy_is_the_faster_of_plain_memmoves(tmp_path, monkeypatch):
    bench = _bench(tmp_path)
    calls = []
    real = rawio.memmove_copy
    monkeypatch.setattr(rawio, "memmove_copy", lambda *args: (calls.append(args), real(*args))[1])
    monkeypatch.setattr(torch.Tensor, "copy_", lambda *a, **k: pytest.fail("the raw host copy used torch copy_"))
    try:
        bench._copies(bench.dram, bench.hbm)
        kind = bench.machine()["baselines"]["host_to_device"]
    finally:
        monkeypatch.undo()
        bench.close()
    total = bench.cfg.total_bytes
    assert calls and all(args[2] == total for args in calls)
    if torch.get_num_threads() > 1:
        assert {len(args) for args in calls} == {3, 4}  # one memmove, and one split over the copy threads
    assert "memmove" in kind and "torch copy_" not in kind


# ----- the cold check compares like with like ----------------------------------------------


def test_cold_check_counts_the_files_in_whole_pages(tmp_path):
    small = tmp_path / "small.json"
    small.write_bytes(b"{}" * 50)  # 100 bytes: one page once cached
    small.read_bytes()
    residue = cached_bytes_in([str(small)])
    text = measure._cold_check(residue, [str(small), str(tmp_path / "gone")])
    cached, total = map(int, re.search(r"(\d+) of (\d+) page-rounded bytes", text).groups())
    assert cached == residue <= total == rawio.PAGE


# ----- output paths are checked first ------------------------------------------------------


@pytest.mark.parametrize("option", ["--json", "--save-profile"])
@pytest.mark.parametrize("bad", ["missing/out.json", "."])
def test_an_unwritable_output_path_fails_before_the_benchmark(tmp_path, monkeypatch, capsys, option, bad):
    monkeypatch.setattr(cli_bench, "run_bench", lambda cfg: pytest.fail("the benchmark ran"))
    argv = [*QUICK, "--dir", str(tmp_path), "--json", str(tmp_path / "ok.json"), option, str(tmp_path / bad)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert f"{option} {tmp_path / bad}" in err and len(err.splitlines()) == 1
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tiercache-bench-")]


def test_good_output_paths_still_get_the_results(tmp_path, capsys):
    out, profile = tmp_path / "b.json", tmp_path / "p.json"
    assert main([*QUICK, "--dir", str(tmp_path), "--json", str(out), "--save-profile", str(profile)]) == 0
    assert json.loads(out.read_text())["config"]["blocks"] == 16 and profile.exists()
