"""Modeled time findings of probe q17 (findings 1, 3, 7 and 8).

Each test builds its inputs in ``tmp_path`` and fails on the code before its fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiercache.cli import main
from tiercache.config import MODEL_PRESETS, parse_layout
from tiercache.sim import replay as replay_module
from tiercache.sim.hardware import PRESETS, REFERENCE_MODEL, REFERENCE_PARAMS

H200 = PRESETS["h200-pcie5-nvme4"]


def _write(path: Path, lines: list[dict]) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def _run(tmp_path: Path, trace: str, *options: str) -> dict:
    out = tmp_path / "r.json"
    assert main(["replay", trace, "--policy", "lru", "--hardware", "h200-pcie5-nvme4", "--out", str(out),
                 "--no-progress", *options]) == 0
    return json.loads(out.read_text())["runs"][0]


def _prefill(c: int, n: int, model: str = "llama-3-8b") -> float:
    """Hand formula (tiercache.sim.prefill): tokens [c, n), weights plus attention over the prefix."""
    layout = MODEL_PRESETS[model]
    flops = 2 * layout.params * (n - c) + 4 * layout.layers * layout.heads * layout.head_dim * (n * (n + 1) - c * (c + 1)) / 2
    return flops / (28_000 * 2 * REFERENCE_PARAMS)


def _requests(tmp_path: Path, *hash_ids: list[int]) -> str:
    return _write(tmp_path / "t.jsonl", [{"timestamp": i, "input_length": 512 * len(ids), "output_length": 1,
                                          "hash_ids": ids} for i, ids in enumerate(hash_ids)])


# ----------------------------------------------------------------------------- finding 1


def test_prefill_speed_scales_by_the_models_parameter_count(tmp_path):
    """The profile's rate is llama-3-8b's; a 70B model prefills REFERENCE_PARAMS / params as
    fast (~8.8x slower), so its recompute and TTFT saved use that rate; a custom layout with
    params= scales the same way, one without it takes the rate unscaled."""
    assert MODEL_PRESETS[REFERENCE_MODEL].params == REFERENCE_PARAMS
    assert H200.prefill_rate(MODEL_PRESETS["llama-3-8b"]) == H200.prefill_tokens_per_s
    big = MODEL_PRESETS["llama-3-70b"]
    assert 8.7 < H200.prefill_tokens_per_s / H200.prefill_rate(big) < 8.9
    trace = _requests(tmp_path, [1, 2], [3, 4], [1, 2])
    runs = {m: _run(tmp_path, trace, "--tiers", "hbm=1,dram=1,nvme=10", "--semantics", "prefix", "--model", m)
            for m in ("llama-3-8b", "llama-3-70b")}
    for m in runs:  # the full hit computes 1 token
        recompute = 2 * _prefill(0, 1024, m) + _prefill(1023, 1024, m)
        assert runs[m]["modeled_seconds"]["recompute"] == pytest.approx(recompute, abs=1e-6)
    rate70 = H200.prefill_rate(big)
    load70 = runs["llama-3-70b"]["modeled_seconds"]["nvme->hbm"]
    assert runs["llama-3-70b"]["ttft_saved_s"] == pytest.approx(_prefill(0, 1023, "llama-3-70b") - load70, abs=2e-6)
    assert runs["llama-3-70b"]["ttft_saved_s"] > 0.2  # it was -0.018 s at the 8B rate
    custom = parse_layout("layers=80,kv_heads=8,head_dim=128,params=70.553706496e9", 512)
    assert custom.params == big.params and H200.prefill_rate(custom) == rate70
    assert H200.prefill_rate(parse_layout("layers=80,kv_heads=8,head_dim=128", 512)) == H200.prefill_tokens_per_s


# ----------------------------------------------------------------------------- finding 3


def test_a_miss_of_a_one_layer_block_costs_one_layers_share_of_prefill(tmp_path):
    """A step trace's block is one layer's KV: a miss recomputes block_tokens / layers
    tokens' worth of whole-model prefill, not a whole-model prefill of block_tokens."""
    trace = _write(tmp_path / "s.jsonl", [
        {"block_tokens": 16},
        {"step": 0, "layer": 0, "read": [], "write": [0]}, {"step": 0, "layer": 1, "read": [], "write": [1]},
        {"step": 1, "layer": 0, "read": [0], "write": []}, {"step": 1, "layer": 1, "read": [1], "write": []}])
    run = _run(tmp_path, trace, "--capacity", "1", "--layout", "layers=2,kv_heads=8,head_dim=128")
    assert run["misses"] == 2
    assert run["modeled_seconds"]["recompute"] == pytest.approx(2 * 16 / 2 / 28_000, abs=1e-6)


# ----------------------------------------------------------------------------- finding 7


def test_a_request_found_entirely_in_the_cache_still_computes_its_last_token(tmp_path, monkeypatch):
    """Saved tokens are at most input_length - 1 per request, in the compiled and the Python
    one-engine replay and in the fleet replay: the repeated 1024-token request saves 1023."""
    trace = _requests(tmp_path, [1, 2], [1, 2])
    prefix = ["--semantics", "prefix", "--model", "llama-3-8b"]
    compiled = _run(tmp_path, trace, "--capacity", "10", *prefix)
    fleet = _run(tmp_path, trace, "--tiers", "hbm=10,remote=10", "--instances", "1", *prefix)
    monkeypatch.setattr(replay_module, "kernel_state_fits", lambda spec, data: False)
    monkeypatch.setattr(replay_module, "_replay_kernels", None)  # would raise if taken
    python = _run(tmp_path, trace, "--capacity", "10", *prefix)
    for run in (compiled, python, fleet):
        assert (run["prefill_tokens"], run["prefill_tokens_saved"]) == (2048, 1023)
        assert run["modeled_seconds"]["recompute"] == pytest.approx(_prefill(0, 1024) + _prefill(1023, 1024), abs=1e-6)
    assert compiled["ttft_saved_s"] == python["ttft_saved_s"] == pytest.approx(_prefill(0, 1023), abs=1e-6)


# ----------------------------------------------------------------------------- finding 8


def test_replay_prints_its_modeled_figures_under_the_table_without_out(tmp_path, capsys):
    """With --model and --hardware, each run gets a line of GiB per link, modeled seconds and
    (prefix semantics) tokens and TTFT saved; the table's lines stay as they were."""
    trace = _requests(tmp_path, [1, 2], [3, 4], [1, 2])
    assert main(["replay", trace, "--policy", "lru", "--tiers", "hbm=1,dram=1,nvme=10", "--semantics", "prefix",
                 "--model", "llama-3-8b", "--hardware", "h200-pcie5-nvme4", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("policy ") and lines[4].startswith("lru ") and "hbm=0 dram=0 nvme=2" in lines[4]
    assert lines[5].startswith("lru prefix: GiB moved ") and "nvme->hbm 0.125" in lines[5]
    assert "modeled s total " in lines[5] and "(recompute 0.074403)" in lines[5]
    assert "prefill tokens saved 1,023 of 3,072; TTFT saved 0.015442 s" in lines[5]
    steps = _write(tmp_path / "s.jsonl", [{"block_tokens": 16}, {"step": 0, "layer": 0, "read": [], "write": [0]},
                                          {"step": 1, "layer": 0, "read": [0], "write": []}])
    layout = ["--capacity", "1", "--layout", "layers=2,kv_heads=8,head_dim=128", "--hardware", "h200-pcie5-nvme4"]
    assert main(["replay", steps, "--policy", "lru", "--no-progress", *layout]) == 0
    out = capsys.readouterr().out
    assert "lru decode: GiB moved " in out and "note: --layout gives no params=" in out and "unscaled" in out
    assert "note: --layout gives no heads=" in out
    assert main(["replay", steps, "--policy", "lru", "--no-progress", *layout[:3], layout[3] + ",params=8e9,heads=32",
                 *layout[4:]]) == 0
    assert "note:" not in capsys.readouterr().out
