"""Probe P3, findings 1 and 3.

1: a step trace's blocks are per layer (the live cache records one key per block and layer,
the generators ``block * layers + layer``), so every replay of one with a layout
(``replay``, ``compare``, the oracleGeneral export) charges one layer's KV per block: bytes
moved, modeled seconds and capacities given as sizes match the live run it replays. A
request trace's block still holds every layer.

3: ``scripts/long_context.py`` refuses a bad option (``--mass`` outside (0, 1), an
unwritable ``--json``, a negative ``--seed``...) up front in one line, never a traceback or
a failure after the whole run.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tiercache import AttentionMode, TieredKVCache
from tiercache.cli import build_parser, main
from tiercache.cli.replay import spec_from_args
from tiercache.config import KVLayout, TierConfig, layout_preset
from tiercache.errors import UserError
from tiercache.sim.loader import load_trace
from tiercache.sim.oracle import read_oracle_general, trace_layout

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = ROOT / "tests" / "data" / "mooncake_head.jsonl"
#: 2 layers, 2 KV heads, head dim 64, fp16, 64-token blocks: 32 KiB a layer, 64 KiB both.
LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, dtype="float16", block_tokens=64)
LAYOUT_OPTION = "layers=2,kv_heads=2,head_dim=64,dtype=float16"
ONE_LAYER = 2 * 2 * 64 * 64 * 2


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _synth_steps(capsys, path: Path, layers: int = 2, block_tokens: int = 16) -> Path:
    argv = ["trace", "synth", "sparse", "-o", path, "--steps", "64", "--blocks", "24", "--k", "4", "--layers", str(layers),
            "--block-tokens", str(block_tokens)]
    assert _cli(capsys, *argv)[0] == 0
    return path


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A live decode run recorded as a step trace (the README's ``record=`` example), and its
    ``stats()`` (bytes moved per link)."""
    folder = tmp_path_factory.mktemp("live")
    record = folder / "steps.jsonl"
    tiers = [TierConfig("hbm", 16), TierConfig("dram", 32), TierConfig("nvme", 512)]
    prompt = list(range(2000))
    torch.manual_seed(0)
    with TieredKVCache(LAYOUT, tiers, eviction="lru", prefetch="topk_speculative", path=folder / "store", device="cpu",
                       record=str(record)) as cache:
        def kv(tokens):
            return torch.randn(2, tokens, 64).half()

        seq = cache.sequence(tokens=prompt, namespace="tenant-a")
        for layer in range(LAYOUT.layers):
            seq.append(layer, kv(len(prompt)), kv(len(prompt)))
        for _ in range(4):
            for layer in range(LAYOUT.layers):
                seq.append(layer, kv(1), kv(1))
                seq.attend(layer, torch.randn(8, 1, 64).half(), AttentionMode.SPARSE, budget=0.25)
        stats = cache.stats()
        block_bytes = cache.layout.block_bytes
        seq.free()
    return record, stats, block_bytes


# ----- finding 1: a step trace's block is one layer's KV ----------------------------------------


def test_replaying_a_live_record_moves_the_bytes_the_live_run_moved(live_run, tmp_path, capsys):
    record, stats, block_bytes = live_run
    assert block_bytes == ONE_LAYER
    out = tmp_path / "r.json"
    code, table, _ = _cli(capsys, "replay", record, "--tiers", "hbm=16,dram=32,nvme=512", "--prefetch", "topk_speculative",
                          "--layout", LAYOUT_OPTION, "--no-progress", "--out", out)
    assert code == 0
    doc = json.loads(out.read_text())
    run = doc["runs"][0]
    assert doc["layout"]["block_bytes"] == ONE_LAYER  # was 65,536: both layers
    assert [t["block_bytes"] for t in run["tiers"]] == [ONE_LAYER] * 3
    assert [t["hits"] for t in run["tiers"]] == [t["hits"] for t in stats["tiers"]]
    assert run["bytes_moved"] == {link: n for link, n in stats["bytes_moved"].items() if n}  # every link, byte for byte
    assert f"64 tokens of one of its 2 layers' KV, {ONE_LAYER:,} B" in table


def test_a_size_capacity_counts_per_layer_blocks(live_run, tmp_path, capsys):
    record, _, _ = live_run
    out = tmp_path / "r.json"
    argv = ["replay", record, "--tiers", "hbm=1MiB,dram=2MiB,nvme=32MiB", "--layout", LAYOUT_OPTION, "--no-progress",
            "--out", out]
    assert _cli(capsys, *argv)[0] == 0
    tiers = json.loads(out.read_text())["runs"][0]["tiers"]
    assert [t["capacity_blocks"] for t in tiers] == [32, 64, 1024]  # 1 MiB / 32 KiB; was 16, 32, 512


def test_a_model_preset_charges_one_of_its_layers_per_step_block(tmp_path, capsys):
    steps = _synth_steps(capsys, tmp_path / "s.jsonl", layers=32, block_tokens=8)
    out = tmp_path / "r.json"
    argv = ["replay", steps, "--tiers", "hbm=8,dram=64", "--model", "llama-3-8b", "--hardware", "h200-pcie5-nvme4",
            "--no-progress", "--out", out]
    assert _cli(capsys, *argv)[0] == 0
    doc = json.loads(out.read_text())
    one = 2 * 8 * 8 * 128 * 2  # K and V, 8 KV heads, 8 tokens, head dim 128, bf16: one layer, 32 KiB
    assert doc["layout"]["block_bytes"] == one == layout_preset("llama-3-8b", 8).block_bytes // 32
    run = doc["runs"][0]
    moves = {t["name"]: t for t in run["tiers"]}
    assert run["bytes_moved"]["hbm->dram"] % one == 0 and run["bytes_moved"]["hbm->dram"] // one == moves["hbm"]["demotions"]
    assert run["modeled_seconds"]  # seconds come from the same per-layer bytes


def test_a_request_trace_keeps_whole_model_blocks(tmp_path, capsys):
    out = tmp_path / "r.json"
    code, table, _ = _cli(capsys, "replay", MOONCAKE, "--capacity", "1GiB", "--model", "llama-3-8b", "--no-progress",
                          "--out", out)
    assert code == 0
    doc = json.loads(out.read_text())
    whole = layout_preset("llama-3-8b", 512).block_bytes  # 64 MiB: 512 tokens of all 32 layers
    assert doc["layout"]["block_bytes"] == whole and doc["runs"][0]["capacity_blocks"] == 2**30 // whole
    assert "512 tokens of all 32 layers' KV" in table


def test_compare_takes_the_same_per_layer_block(tmp_path, capsys):
    steps = _synth_steps(capsys, tmp_path / "s.jsonl")
    args = build_parser().parse_args(["compare", str(steps), "--capacity", "1MiB", "--model", "llama-3-8b"])
    _, spec = spec_from_args(args)
    assert spec.layout.per_layer and spec.layout.block_bytes == 2 * 8 * 16 * 128 * 2
    assert spec.capacities == (2**20 // spec.layout.block_bytes,)


def test_trace_layout_is_per_layer_exactly_for_step_traces(tmp_path, capsys):
    steps = load_trace(_synth_steps(capsys, tmp_path / "s.jsonl"))
    layout = trace_layout(steps, layout_preset("llama-3-8b"))
    assert layout.per_layer and layout.block_tokens == 16 and layout.block_bytes == 2 * 8 * 16 * 128 * 2
    requests = trace_layout(load_trace(MOONCAKE), layout_preset("llama-3-8b"))
    assert not requests.per_layer and requests.block_tokens == 512
    with pytest.raises(UserError, match="request trace's blocks hold every layer"):
        trace_layout(load_trace(MOONCAKE), KVLayout(32, 8, 128, per_layer=True))


@pytest.mark.parametrize("flag", [[], ["--per-layer"]])
def test_export_sizes_step_records_as_one_layer(tmp_path, capsys, flag):
    steps = _synth_steps(capsys, tmp_path / "s.jsonl", layers=32)
    out = tmp_path / "s.bin"
    assert _cli(capsys, "trace", "export", steps, "-o", out, "--model", "llama-3-8b", *flag)[0] == 0
    assert set(read_oracle_general(out)["obj_size"].tolist()) == {2 * 8 * 16 * 128 * 2}


# ----- finding 3: long_context.py refuses bad options up front ----------------------------------


def _long_context():
    spec = importlib.util.spec_from_file_location("long_context_p3", ROOT / "scripts" / "long_context.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_SMALL = ["--tokens", "4096", "--block-tokens", "64", "--hbm", "4", "--dram", "8", "--steps", "2", "--exact-steps", "1",
          "--no-progress"]


@pytest.mark.parametrize("extra, fragment", [
    (["--mass", "1.5"], "--mass"), (["--mass", "0"], "--mass"), (["--mass", "nan"], "--mass"),
    (["--json", "/nonexistent/dir/x.json"], "--json /nonexistent/dir/x.json"),
    (["--seed", "-1"], "--seed"), (["--reference-steps", "-1"], "--reference-steps"),
    (["--path", "/nonexistent/dir"], "--path"), (["--speculate", "9"], "--speculate"),
    (["--prefetch", "bogus"], "--prefetch"), (["--hbm", "0"], "--hbm"),
])
def test_long_context_refuses_a_bad_option_before_any_work(extra, fragment, capsys, monkeypatch):
    lc = _long_context()
    monkeypatch.setattr(lc, "run", lambda args: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as info:
        lc.main(_SMALL + extra)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert fragment in err.strip().splitlines()[-1]


def test_long_context_writes_its_json_whole_or_says_in_one_line_why_not(tmp_path, capsys, monkeypatch):
    lc = _long_context()
    figures = {"tokens": 1, "overlap_timings": {}}
    monkeypatch.setattr(lc, "print_table", lambda figures: None)
    monkeypatch.setattr(lc, "overlap_problem", lambda timings: None)
    out = tmp_path / "f.json"
    out.write_text("earlier")
    monkeypatch.setattr(lc, "run", lambda args: figures)
    assert lc.main(_SMALL + ["--json", str(out)]) == 0
    assert json.loads(out.read_text()) == figures
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]  # written beside it, renamed over it
    gone = tmp_path / "gone"
    gone.mkdir()

    def folder_removed_during_the_run(args):
        gone.rmdir()
        return figures

    monkeypatch.setattr(lc, "run", folder_removed_during_the_run)
    capsys.readouterr()
    assert lc.main(_SMALL + ["--json", str(gone / "f.json")]) == 1  # was a FileNotFoundError traceback
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "--json" in err


def test_the_python_sweep_charges_a_step_block_as_one_layer_too(tmp_path, capsys):
    """``sweep()`` called directly with a whole-model layout decides the block as the CLI does."""
    from tiercache.config import CacheConfig
    from tiercache.results import Semantics
    from tiercache.sim.sweep import SweepSpec, sweep

    trace = load_trace(_synth_steps(capsys, tmp_path / "s.jsonl", layers=32, block_tokens=8))
    cache = CacheConfig((TierConfig("hbm", 8), TierConfig("dram", 64)))
    doc = sweep(trace, SweepSpec(("lru",), (Semantics.OBJECT,), (), cache, "always", layout_preset("llama-3-8b", 8)))  # a step trace: decode
    one = layout_preset("llama-3-8b", 8).block_bytes // 32
    assert doc.layout.block_bytes == one
    run = doc.runs[0]
    assert run.bytes_moved["hbm->dram"] == one * next(t for t in run.tiers if t.name == "hbm").demotions > 0


def test_the_report_says_whose_kv_a_block_holds(tmp_path, capsys):
    steps = _synth_steps(capsys, tmp_path / "s.jsonl", layers=32, block_tokens=8)
    for trace, name, tiers, scope in ((steps, "step", "hbm=8,dram=64", "one layer's KV"),
                                      (MOONCAKE, "request", "hbm=8,dram=64", "KV (every layer)")):
        out = tmp_path / f"{name}.json"
        assert _cli(capsys, "replay", trace, "--tiers", tiers, "--model", "llama-3-8b", "--no-progress", "--out", out)[0] == 0
        assert _cli(capsys, "report", out, "-o", tmp_path / name)[0] == 0
        text = (tmp_path / name / "report.md").read_text()
        assert f"of {scope}" in text, name
