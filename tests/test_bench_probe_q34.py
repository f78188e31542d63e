"""Probe q34: the benchmark scripts' "cold", "O_DIRECT" and per-block figures mean what they say.

1. ``bench_quant``'s cold disk reads are evicted and ``mincore``-checked before each read run
   (files that stay cached, as on tmpfs, end the run with exit 1); its files go under ``--dir``;
2. its codec side decodes (encodes) each block from and into its own memory, as the disk side
   reads (writes) each block into (from) its own buffer;
3. ``step_timings`` (``bench_decode``, ``long_context``) makes the NVMe chunk files cold before
   its I/O-only and pipelined regions and refuses files that stay cached;
4. ``bench_close`` refuses a round with no scratch on NVMe and reports time per NVMe block deleted;
5. ``bench_close`` checks the closed store's index as reopened from its files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import tiercache.live.store as live_store
from tiercache.bench import decode as bdecode
from tiercache.config import Codec
from tiercache.data.codec_base import BlockCodec
from tiercache.data.nvme import NVMeStore

from test_bench_probe_b1 import _spread_sequence
from test_script_bench_honesty import _script

SHM = Path("/dev/shm")


def _shm_is_tmpfs() -> bool:
    """Whether /dev/shm is a writable tmpfs mount (``/proc/self/mounts``)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            kinds = {fields[1]: fields[2] for fields in (line.split() for line in mounts) if len(fields) > 2}
    except OSError:
        return False
    return kinds.get(str(SHM)) == "tmpfs" and os.access(SHM, os.W_OK)


@pytest.fixture
def shm_folder(tmp_path):
    """A fresh folder on /dev/shm (a memory filesystem: mincore finds its files cached), or a skip."""
    if not _shm_is_tmpfs():
        pytest.skip("no writable tmpfs at /dev/shm here")
    folder = SHM / f"tiercache-q34-{os.getpid()}-{tmp_path.name}"
    folder.mkdir()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _block(quant) -> torch.Tensor:
    return torch.randn(1, 2, 8, quant.TOKENS, quant.DIM, generator=torch.Generator().manual_seed(3)).half()


# ----- 1. bench_quant: cold reads are checked cold -------------------------------------------


def test_bench_quant_checks_every_read_run_cold_on_a_disk(tmp_path, monkeypatch):
    quant = _script("bench_quant")
    seen = []

    def spy(paths, region, what="NVMe chunk files"):
        bdecode.make_cold(paths, region, what)
        seen.append((len(paths), bdecode.cached_bytes_in(paths)))

    monkeypatch.setattr(quant, "make_cold", spy)
    quant.disk_rounds(Codec.INT8, _block(quant), str(tmp_path), rounds=2, blocks=2)
    assert len(seen) == 3  # the warm-up read run and both rounds
    assert all(files == quant.DISK_THREADS and cached == 0 for files, cached in seen)


def test_bench_quant_exits_1_when_the_disk_files_stay_cached(tmp_path, monkeypatch, capsys):
    quant = _script("bench_quant")
    monkeypatch.setattr(bdecode, "evict_from_page_cache", lambda paths: 8192)  # a filesystem that keeps them
    out = tmp_path / "q.json"
    args = ["--layers", "1", "--blocks", "1", "--repeats", "1", "--disk-rounds", "1", "--disk-blocks", "1",
            "--dir", str(tmp_path), "--json", str(out)]
    assert quant.main(args) == 1
    captured = capsys.readouterr()
    assert "8192 bytes of the 4 raw block files" in captured.err and "no figures reported" in captured.err
    assert "GB/s" not in captured.out and not out.exists()
    assert not list(tmp_path.iterdir())  # its temporary folder went with it


def test_bench_quant_refuses_reads_from_tmpfs(shm_folder):
    quant = _script("bench_quant")
    with pytest.raises(bdecode.ColdReadError, match="stayed in the page cache"):
        quant.disk_rounds(Codec.INT4, _block(quant), str(shm_folder), rounds=1, blocks=1)
    assert not list(shm_folder.iterdir())


def test_bench_quant_dir_option_names_the_default_and_must_exist(tmp_path, capsys):
    quant = _script("bench_quant")
    with pytest.raises(SystemExit) as exit_info:
        quant.main(["--help"])
    assert exit_info.value.code == 0 and "(default: the current directory)" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as exit_info:
        quant.main(["--dir", str(tmp_path / "missing")])
    assert exit_info.value.code == 2 and "does not exist" in capsys.readouterr().err


# ----- 2. bench_quant: the codec side uses distinct memory per block -------------------------


def test_bench_quant_codec_side_uses_its_own_buffers_per_block(monkeypatch):
    quant = _script("bench_quant")
    calls = {"encode": [], "decode": []}
    real_encode, real_decode = BlockCodec.encode_into, BlockCodec.decode_from

    def encode_into(self, block, buf):
        calls["encode"].append((block.data_ptr(), buf.data_ptr()))
        return real_encode(self, block, buf)

    def decode_from(self, buf, dtype, out):
        calls["decode"].append((buf.data_ptr(), out.data_ptr()))
        return real_decode(self, buf, dtype, out)

    monkeypatch.setattr(BlockCodec, "encode_into", encode_into)
    monkeypatch.setattr(BlockCodec, "decode_from", decode_from)
    encodes, decodes, encoded, _ = quant.codec_ops(Codec.INT8, _block(quant), 3)
    assert encodes(0) > 0 and decodes(0) > 0  # every output checked against the untimed encode/decode
    for name in ("encode", "decode"):
        sources, outputs = zip(*calls[name])
        assert len(calls[name]) == 3 and len(set(sources)) == 3 and len(set(outputs)) == 3
        assert not set(sources) & set(outputs)
    assert [p for p, _ in calls["decode"]] == [e.data_ptr() for e in encoded]


def test_bench_quant_codec_side_checks_every_blocks_output(monkeypatch):
    quant = _script("bench_quant")
    real = BlockCodec.decode_from
    count = []

    def second_writes_nothing(self, buf, dtype, out):
        count.append(1)
        return out if len(count) == 2 else real(self, buf, dtype, out)

    monkeypatch.setattr(BlockCodec, "decode_from", second_writes_nothing)
    _, decodes, _, _ = quant.codec_ops(Codec.FP8, _block(quant), 3)
    with pytest.raises(quant.OutputMismatch, match="decode_from"):
        decodes(0)


# ----- 3. step_timings: NVMe reads start cold, or no figure ------------------------------------


def test_step_timings_makes_the_nvme_chunks_cold_before_io_and_pipelined(tmp_path, monkeypatch):
    events = []

    def stopwatch(device):
        return lambda: events.append("clock") or float(events.count("clock"))

    def cold(paths, region, what="NVMe chunk files"):
        real_cold(paths, region, what)
        events.append((region, len(paths), bdecode.cached_bytes_in(paths)))

    real_cold = bdecode.make_cold
    monkeypatch.setattr(bdecode, "_stopwatch", stopwatch)
    monkeypatch.setattr(bdecode, "make_cold", cold)
    cache, seq, kv = _spread_sequence(tmp_path)
    with cache:
        nvme = cache.store._media[2]
        on_nvme = len(bdecode.nvme_chunk_paths(seq.stream_source(0)))
        assert on_nvme and all(p.startswith(nvme.path) for p in bdecode.nvme_chunk_paths(seq.stream_source(0)))
        bdecode.step_timings(seq, 0, kv.query(0, 4)[0], repeats=2)
    one = [("I/O only", on_nvme, 0), "clock", "clock", "clock", "clock", ("pipelined", on_nvme, 0), "clock", "clock"]
    assert events == one * 2


def test_step_timings_refuses_chunks_that_stay_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(bdecode, "evict_from_page_cache", lambda paths: 4096)
    cache, seq, kv = _spread_sequence(tmp_path)
    with cache, pytest.raises(bdecode.ColdReadError, match="I/O only: 4096 bytes of the .* NVMe chunk files"):
        bdecode.step_timings(seq, 0, kv.query(0, 4)[0], repeats=1)
    assert issubclass(bdecode.ColdReadError, bdecode.StepCheckError)  # long_context exits 1 on it too


_DECODE_ARGS = ["--tokens", "4096", "--block-tokens", "256", "--kv-heads", "2", "--head-dim", "16", "--q-heads", "4",
                "--window-blocks", "2", "--depth", "2", "--repeats", "1", "--threads", "1"]


def test_bench_decode_exits_1_on_a_tmpfs_path(shm_folder, tmp_path, capsys, monkeypatch):
    """Refused before the store is built: a probe file is made cold first (docs check D7: the
    refusal came after about 1 GiB of KV was written there and the I/O-only region began)."""
    bench_decode = _script("bench_decode")
    monkeypatch.setattr(bench_decode, "TieredKVCache", None)  # the refusal must come before any store
    threads = torch.get_num_threads()
    out = tmp_path / "d.json"
    try:
        assert bench_decode.main(_DECODE_ARGS + ["--path", str(shm_folder), "--json", str(out)]) == 1
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert f"--path {shm_folder}: a probe written there:" in err and "stayed in the page cache" in err and "no figures" in err
    assert not out.exists() and not list(shm_folder.iterdir())


# ----- 4 and 5. bench_close: blocks on NVMe, per NVMe block, the reopened index -------------


def test_bench_close_refuses_a_case_where_nothing_reaches_nvme_before_any_work(tmp_path, capsys):
    """Probe Q55: the refusal came after the earlier cases' runs (11 s for --scratch 2000,16)."""
    out = tmp_path / "close.json"
    with pytest.raises(SystemExit) as stopped:
        _script("bench_close").main(["--scratch", "2000,4,16", "--reps", "1", "--dir", str(tmp_path), "--json", str(out)])
    assert stopped.value.code == 2
    assert "--scratch 4: HBM and DRAM hold 16 blocks a layer, so none would reach NVMe" in capsys.readouterr().err
    assert not out.exists()


def test_bench_close_divides_by_the_blocks_deleted_from_nvme(tmp_path):
    out = tmp_path / "close.json"
    assert _script("bench_close").main(["--scratch", "17", "--reps", "1", "--dir", str(tmp_path), "--json", str(out)]) == 0
    figures = json.loads(out.read_text(encoding="utf-8"))["34"]
    for row in figures.values():
        assert row["nvme_blocks"] == 2  # 34 blocks, 32 held by HBM and DRAM
        assert row["us_per_nvme_block"] == pytest.approx(row["close_ms"] * 1e3 / 2)
        assert row["us_per_block"] == pytest.approx(row["close_ms"] * 1e3 / 34)


def test_bench_close_reads_the_index_reopened_from_disk(tmp_path, monkeypatch, capsys):
    """The closed store's memory says "empty" but its files still list the scratch: only a
    reopen from disk sees it."""
    real = NVMeStore.items
    monkeypatch.setattr(live_store, "drop_scratch", lambda *args: 0)  # a close that deletes nothing
    monkeypatch.setattr(NVMeStore, "items", lambda self: [] if self._closed else real(self))
    assert _script("bench_close").main(["--scratch", "20", "--reps", "1", "--dir", str(tmp_path)]) == 1
    assert "left 8 blocks of a decode without ids on NVMe" in capsys.readouterr().err
