"""Probe V, benchmark scripts: every figure means what its label says and bad input ends
with one line before any work.

* ``bench_memory``'s rss comes from a run of the case without ``tracemalloc`` (finding 1);
* ``bench_decode``'s calibration reaches the 2x band, or the run exits 1 (finding 5);
* ``bench_store`` checks every read, verifies it cold and alternates the sides (finding 6);
* the scripts refuse bad counts, folders and output files up front (finding 7).
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from tiercache.bench import decode as bdecode
from tiercache.bench.remote import RemoteBenchConfig
from tiercache.config import KVLayout
from tiercache.live.store import TieredKVStore

from test_script_bench_honesty import _script, keep_torch_threads  # noqa: F401 (keep_torch_threads: a fixture)

ROOT = Path(__file__).resolve().parents[1]




# ----- bench_memory: rss measured without tracemalloc (finding 1) ---------------------------


def test_bench_memory_reads_rss_only_in_a_pass_without_tracemalloc(monkeypatch, capsys):
    memory = _script("bench_memory")
    tracing_at_rss_reads = []

    class Process:
        def memory_info(self):
            tracing_at_rss_reads.append(tracemalloc.is_tracing())
            return type("Info", (), {"rss": 1 << 20})()

    monkeypatch.setattr(memory.psutil, "Process", Process)
    assert memory.child(["rss", "slottable", "1000", "1"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == {"rss"}
    assert tracing_at_rss_reads and not any(tracing_at_rss_reads)
    tracing_at_rss_reads.clear()
    assert memory.child(["traced", "slottable", "1000", "1"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == {"traced", "peak"} and not tracing_at_rss_reads


def test_bench_memory_takes_rss_and_traced_bytes_from_separate_children(monkeypatch):
    memory = _script("bench_memory")
    runs = []

    def fake_child(*args):
        runs.append(args)
        return {"rss": 373} if args[0] == "rss" else {"traced": 207, "peak": 300}

    monkeypatch.setattr(memory, "run_child", fake_child)
    assert memory.run_case("slottable", "100", "1") == {"rss": 373, "traced": 207, "peak": 300}
    assert sorted(runs) == [("rss", "slottable", "100", "1"), ("traced", "slottable", "100", "1")]


# ----- bench_decode: the calibration reaches the 2x band, or no figures (finding 5) ---------

_DECODE_ARGS = ["--tokens", "2048", "--block-tokens", "256", "--kv-heads", "2", "--head-dim", "16",
                "--window-blocks", "2", "--depth", "2", "--repeats", "1", "--threads", "1"]


def _fake_timings(io: float, compute_of_heads):
    """A ``step_timings`` whose I/O takes ``io`` s and compute ``compute_of_heads(q_heads)`` s."""
    def step_timings(seq, layer, q, repeats=3):
        compute = compute_of_heads(q.shape[0])
        ratio = io / compute
        return {"io_only_seconds": io, "compute_only_seconds": compute, "pipelined_seconds": max(io, compute),
                "overlap_efficiency": 1.0, "io_compute_ratio": ratio, "balanced": bdecode.is_balanced(ratio),
                "plausible": True, "output_rel_err": 0.0}
    return step_timings


def test_bench_decode_calibration_goes_past_128_heads_to_reach_the_band(tmp_path, monkeypatch, keep_torch_threads):
    bench_decode = _script("bench_decode")
    # probe V's machine: 16x the heads gave 1.9x the compute (the fp16 -> fp32 conversion dominates)
    monkeypatch.setattr(bench_decode, "step_timings", _fake_timings(0.38, lambda heads: 0.07 + 0.000625 * heads))
    out = tmp_path / "dec.json"
    assert bench_decode.main(_DECODE_ARGS + ["--path", str(tmp_path), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["balanced"] is True and figures["q_heads"] > 128 and figures["q_heads_calibrated"] is True
    assert 0.5 <= figures["io_compute_ratio"] <= 2.0


def test_bench_decode_exits_1_when_calibration_cannot_balance(tmp_path, monkeypatch, capsys, keep_torch_threads):
    bench_decode = _script("bench_decode")
    monkeypatch.setattr(bench_decode, "step_timings", _fake_timings(0.9, lambda heads: 0.3))  # compute ignores heads
    out = tmp_path / "dec.json"
    assert bench_decode.main(_DECODE_ARGS + ["--path", str(tmp_path), "--json", str(out)]) == 1
    assert "not within 2x after calibrating" in capsys.readouterr().err and not out.exists()


def test_bench_decode_fixed_heads_report_their_ratio_as_not_calibrated(tmp_path, monkeypatch, keep_torch_threads):
    bench_decode = _script("bench_decode")
    monkeypatch.setattr(bench_decode, "step_timings", _fake_timings(0.9, lambda heads: 0.3))
    out = tmp_path / "dec.json"
    assert bench_decode.main(_DECODE_ARGS + ["--q-heads", "4", "--path", str(tmp_path), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["balanced"] is False and figures["q_heads_calibrated"] is False and figures["q_heads"] == 4


def test_bench_decode_settles_a_step_that_left_the_band(tmp_path, monkeypatch, keep_torch_threads):
    bench_decode = _script("bench_decode")
    calls = []

    def noisy(seq, layer, q, repeats=3):  # calibration sees balance at 8 heads; the real step does not
        heads = q.shape[0]
        calls.append((heads, repeats))
        compute = 0.2 * heads / 8 if repeats == bench_decode.CALIBRATION_REPEATS else 0.08 * heads / 8
        return _fake_timings(0.2, lambda _: compute)(seq, layer, q, repeats)

    monkeypatch.setattr(bench_decode, "step_timings", noisy)
    out = tmp_path / "dec.json"
    assert bench_decode.main(_DECODE_ARGS + ["--path", str(tmp_path), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["q_heads"] == 16 and figures["balanced"] is True
    assert calls[-2:] == [(8, 1), (16, 1)]


# ----- bench_store: every read checked, cold, sides alternated (finding 6) ------------------

_STORE_ARGS = ["--blocks", "4", "--batch", "2", "--reps", "2"]


def _store_main(store_script, tmp_path) -> tuple[int, Path]:
    out = tmp_path / "store.json"
    return store_script.main(_STORE_ARGS + ["--dir", str(tmp_path), "--json", str(out)]), out


def test_bench_store_alternates_the_side_that_goes_first(tmp_path, monkeypatch):
    store_script = _script("bench_store")
    order, real_raw, real_store = [], store_script.time_raw, store_script.time_store
    monkeypatch.setattr(store_script, "time_raw", lambda *a: order.append("raw") or real_raw(*a))
    monkeypatch.setattr(store_script, "time_store", lambda *a: order.append("store") or real_store(*a))
    code, out = _store_main(store_script, tmp_path)
    assert code == 0
    pairs = [tuple(order[i : i + 2]) for i in range(0, len(order), 2)]
    assert pairs == [("raw", "store"), ("store", "raw"), ("store", "raw"), ("raw", "store")]
    figures = json.loads(out.read_text())
    assert figures["reads_checked"] and figures["cold_verified"] and figures["get"]["ratio"] > 0


def test_bench_store_blocks_are_distinct(tmp_path):
    store_script = _script("bench_store")
    store, keys, digests = store_script.prepare(str(tmp_path / "nvme"), 4, 2)
    store.close(persist=False)
    assert len(keys) == 4 and len(set(digests.tolist())) == 4


def test_bench_store_refuses_a_get_that_serves_another_keys_block(tmp_path, monkeypatch, capsys):
    store_script = _script("bench_store")
    real_get = TieredKVStore.get
    every_key = [store_script._key(i) for i in range(4)]

    def shifted_get(self, keys, out=None):  # the next batch's blocks: the same bytes before the fix
        wrong = [every_key[(every_key.index(k) + 2) % 4] for k in keys]
        return real_get(self, wrong, out=out)

    monkeypatch.setattr(TieredKVStore, "get", shifted_get)
    code, out = _store_main(store_script, tmp_path)
    assert code == 1 and "do not hold their source's bytes" in capsys.readouterr().err and not out.exists()


def test_bench_store_refuses_a_raw_read_that_delivers_nothing(tmp_path, monkeypatch, capsys):
    store_script = _script("bench_store")
    monkeypatch.setattr(store_script, "read_files", lambda paths, dests, tails: (0.001, True))
    code, out = _store_main(store_script, tmp_path)
    assert code == 1 and "raw O_DIRECT preadv" in capsys.readouterr().err and not out.exists()


def test_bench_store_refuses_reads_that_are_not_cold(tmp_path, monkeypatch, capsys):
    store_script = _script("bench_store")
    monkeypatch.setattr(store_script, "evict_from_page_cache", lambda paths: 4096)
    code, out = _store_main(store_script, tmp_path)
    assert code == 1 and "stayed in the page cache" in capsys.readouterr().err and not out.exists()


# ----- bad input: one line, exit 2, before any work (finding 7) ------------------------------


@pytest.mark.parametrize("script, argv, message", [
    ("bench_remote", ["--reps", "0"], "argument --reps: expected a positive integer, got 0"),
    ("bench_remote", ["--blocks", "0"], "argument --blocks: expected a positive integer, got 0"),
    ("bench_remote", ["--model", "nope"], "--model: unknown model preset 'nope'"),
    ("bench_memory", ["--sizes", "0"], "argument --sizes: expected a positive integer, got 0"),
    ("bench_memory", ["--sizes", "10,x"], "argument --sizes: expected a positive integer, got 'x'"),
    ("bench_memory", ["--store-slots", "10", "--store-blocks", "11"], "--store-blocks: at most --store-slots 10, got 11"),
    ("bench_store", ["--dir", "{tmp}/missing"], "argument --dir: folder {tmp}/missing does not exist"),
    ("bench_store", ["--dir", "{tmp}/file"], "argument --dir: {tmp}/file is not a folder"),
    ("bench_decode", ["--path", "{tmp}/missing"], "argument --path: folder {tmp}/missing does not exist"),
    ("bench_decode", ["--json", "{tmp}"], "--json {tmp}: is a folder; give a file name"),
    ("bench_store", ["--json", "{tmp}/missing/out.json"], "--json {tmp}/missing/out.json: folder {tmp}/missing does not exist"),
    ("bench_memory", ["--json", "{tmp}"], "--json {tmp}: is a folder; give a file name"),
    ("bench_remote", ["--json", "{tmp}"], "--json {tmp}: is a folder; give a file name"),
])
def test_scripts_refuse_bad_input_in_one_line_before_any_work(script, argv, message, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    module = _script(script)
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message.format(tmp=tmp_path) in err and "Traceback" not in err


def test_bench_quant_refuses_an_unwritable_json_before_measuring(tmp_path, monkeypatch, capsys):
    quant = _script("bench_quant")
    monkeypatch.setattr(quant, "measure", lambda args: pytest.fail("measured before checking --json"))
    with pytest.raises(SystemExit) as exit_info:
        quant.main(["--no-disk", "--json", str(tmp_path)])
    assert exit_info.value.code == 2 and f"--json {tmp_path}: is a folder" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["blocks", "reps"])
def test_remote_bench_config_refuses_a_zero_count(field):
    layout = KVLayout(1, 8, 128, "bfloat16", 256, per_layer=True)
    with pytest.raises(ValueError, match=f"{field} must be at least 1, got 0"):
        RemoteBenchConfig(layout, **{field: 0})


def test_bench_memory_exits_1_when_a_case_failed(monkeypatch, capsys):
    bm = _script("bench_memory")
    ok = {"traced": 8, "rss": 8, "peak": 8}
    result = {"directory": {"10": {"empty": ok}}, "slottable": {"10": {"full": ok}},
              "reopen": {"error": "OSError: no such folder"}, "replay": {**ok, "accesses": 4}}
    monkeypatch.setattr(bm, "measure", lambda *args: result)
    assert bm.main(["--sizes", "10"]) == 1
    captured = capsys.readouterr()
    assert "NVMeStore reopen: error: OSError" in captured.out and "reopen failed" in captured.err


def test_bench_memory_replay_case_warms_up_on_another_trace_first(monkeypatch):
    bm = _script("bench_memory")
    import tiercache.sim.loader as loader

    loaded, real = [], loader.load_trace
    monkeypatch.setattr(loader, "load_trace", lambda path, *a, **k: (loaded.append(path), real(path, *a, **k))[1])

    class Meter:
        def start(self):
            loaded.append("start")

        def stop(self):
            return {"peak": 0}

    bm.case_replay(Meter())
    assert loaded == [str(bm.WARM_UP_TRACE), "start", str(bm.TRACE)]
