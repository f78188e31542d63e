"""Prefill modeled with attention over the context (``tiercache.sim.prefill``).

Computing prompt tokens [c, n) costs 2 P (n - c) + 4 L H d sum_{t=c}^{n-1} (t + 1) FLOPs at the
FLOP rate F = prefill_tokens_per_s * 2 * P_ref. The expected figures below are computed by
hand, per request, in float64.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tiercache.cli import main
from tiercache.config import MODEL_PRESETS, Semantics, TierConfig, layout_preset, parse_layout
from tiercache.sim import replay as replay_module
from tiercache.sim.fleet import FleetSpec, Route, replay_fleet
from tiercache.sim.hardware import PRESETS, REFERENCE_PARAMS
from tiercache.sim.loader import load_trace
from tiercache.sim.prefill import PrefillCost, causal_pairs
from tiercache.sim.replay import ReplayData, RunSpec, replay

H200 = PRESETS["h200-pcie5-nvme4"]
P, L, H, D = 8_030_261_248.0, 32.0, 32.0, 128.0  # llama-3-8b
F = 28_000.0 * 2.0 * 8_030_261_248.0


def _seconds(c: float, n: float) -> float:
    """Hand formula, float64: tokens [c, n) of one request."""
    pairs = sum(t + 1.0 for t in range(int(c), int(n)))
    return (2.0 * P * (n - c) + 4.0 * L * H * D * pairs) / F


def _write(tmp_path: Path, requests: list[tuple[int, list[int]]]) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": ids}) + "\n"
                            for i, (n, ids) in enumerate(requests)))
    return str(path)


def _run(trace: str, tmp_path: Path, *options: str) -> dict:
    out = tmp_path / "r.json"
    assert main(["replay", trace, "--policy", "lru", "--semantics", "prefix", "--hardware", "h200-pcie5-nvme4",
                 "--out", str(out), "--no-progress", *options]) == 0
    return json.loads(out.read_text())["runs"][0]


# Three requests: 1000 tokens (nothing cached), 1400 tokens reusing 2 blocks (1024 tokens),
# 1536 tokens found whole (1535 saved: the last token is computed).
REQUESTS = [(1000, [1, 2]), (1400, [1, 2, 3]), (1536, [1, 2, 3])]
SAVED = [0, 1024, 1535]


def test_recompute_and_ttft_saved_match_a_hand_computation_with_attention(tmp_path):
    """HBM only (no loads): TTFT saved is the prefill of each request's saved tokens [0, c),
    recompute that of its tokens [c, n), attention over the prefix included."""
    run = _run(_write(tmp_path, REQUESTS), tmp_path, "--capacity", "10", "--model", "llama-3-8b")
    recompute = sum(_seconds(c, n) for c, (n, _) in zip(SAVED, REQUESTS))
    saved = sum(_seconds(0, c) for c in SAVED)
    assert run["prefill_tokens_saved"] == 2559
    assert run["modeled_seconds"]["recompute"] == pytest.approx(recompute, abs=1e-6)
    assert run["ttft_saved_s"] == pytest.approx(saved, abs=1e-6)
    weights_only = (3936 - 2559) / 28_000
    assert run["modeled_seconds"]["recompute"] > weights_only + 0.5e-3  # attention adds ~0.6 ms here
    # time(0, n) - time(c, n) is the prefill of [0, c): the same per request
    assert _seconds(0, 1400) - _seconds(1024, 1400) == pytest.approx(_seconds(0, 1024), rel=1e-12)


def test_ttft_saved_subtracts_the_loads_of_a_hierarchy(tmp_path):
    """With lower tiers the loads' modeled seconds come off the hand-computed prefill saved."""
    run = _run(_write(tmp_path, REQUESTS), tmp_path, "--tiers", "hbm=1,dram=1,nvme=10", "--model", "llama-3-8b")
    seconds = run["modeled_seconds"]
    loads = sum(v for k, v in seconds.items() if k in ("dram->hbm", "nvme->dram", "nvme->hbm"))
    saved = sum(_seconds(0, c) for c in SAVED)
    assert run["prefill_tokens_saved"] == sum(SAVED)
    assert run["ttft_saved_s"] == pytest.approx(saved - loads, abs=3e-6)


def test_a_long_prompts_suffix_costs_more_than_a_short_prompt():
    """The last 512 tokens of a 131,072-token prompt cost ~5.2x a 512-token prompt (llama-3-8b)."""
    cost = PrefillCost.of(H200, MODEL_PRESETS["llama-3-8b"])
    suffix = cost.seconds(512, causal_pairs(np.array([131_072]), np.array([130_560])))
    short = cost.seconds(512, causal_pairs(np.array([512])))
    assert 5.1 < suffix / short < 5.3
    assert cost.flops_per_s == 28_000 * 2 * REFERENCE_PARAMS


@pytest.mark.parametrize("semantics", [Semantics.PREFIX, Semantics.OBJECT])
def test_compiled_and_python_replays_give_the_same_seconds(tmp_path, monkeypatch, semantics):
    """Both replay paths feed the same per-request saved tokens to one cost function."""
    requests = [(n, list(range(k, k + (n + 511) // 512))) for k, n in ((0, 9000), (3, 20000), (0, 30000), (7, 4000))]
    data = ReplayData.prepare(load_trace(_write(tmp_path, requests)), layout_preset("llama-3-8b", 512), H200)
    spec = RunSpec("lru", semantics, (TierConfig("hbm", 8), TierConfig("dram", 30)))
    if not replay_module.use_kernels(spec):
        pytest.skip("numba not installed")
    compiled = replay(spec, data)
    monkeypatch.setattr(replay_module, "use_kernels", lambda spec: False)
    python = replay(spec, data)
    assert compiled.modeled_seconds == python.modeled_seconds and compiled.ttft_saved_s == python.ttft_saved_s
    assert compiled.modeled_seconds["recompute"] > 0


def test_a_fleet_of_one_on_private_tiers_models_what_one_engine_does(tmp_path):
    """The fleet's TTFT saved and recompute use the same per-request model as one engine."""
    requests = [(n, list(range(k, k + (n + 511) // 512))) for k, n in ((0, 9000), (3, 20000), (0, 30000), (7, 4000))]
    trace = load_trace(_write(tmp_path, requests))
    layout = layout_preset("llama-3-8b", 512)
    fleet = replay_fleet(FleetSpec(1, (TierConfig("hbm", 8), TierConfig("dram", 30)), 0, Route.ROUND_ROBIN), trace,
                         layout, shared=False, profile=H200)
    one = replay(RunSpec("lru", Semantics.PREFIX, (TierConfig("hbm", 8), TierConfig("dram", 30))),
                 ReplayData.prepare(trace, layout, H200))
    assert fleet.ttft_saved_s == one.ttft_saved_s and fleet.prefill_tokens_saved == one.prefill_tokens_saved
    assert fleet.modeled_seconds["recompute"] == one.modeled_seconds["recompute"]


def test_a_layout_without_heads_leaves_attention_out_and_says_so(tmp_path, capsys):
    """heads= gives the attention term (as the preset's); without it, weights only and a note."""
    trace = _write(tmp_path, REQUESTS)
    spec = "layers=32,kv_heads=8,head_dim=128,params=8030261248"
    with_heads = _run(trace, tmp_path, "--capacity", "10", "--layout", spec + ",heads=32")
    assert "no heads=" not in capsys.readouterr().out
    preset = _run(trace, tmp_path, "--capacity", "10", "--model", "llama-3-8b")
    assert with_heads["modeled_seconds"] == preset["modeled_seconds"] and with_heads["ttft_saved_s"] == preset["ttft_saved_s"]
    without = _run(trace, tmp_path, "--capacity", "10", "--layout", spec)
    assert "note: --layout gives no heads=" in capsys.readouterr().out
    assert without["modeled_seconds"]["recompute"] == pytest.approx((3936 - 2559) / 28_000, abs=1e-6)
    assert parse_layout(spec + ",heads=64", 512).heads == 64


def test_a_step_traces_miss_is_one_layers_share_of_its_block_at_the_mean_read_position(tmp_path):
    """Decode: a miss recomputes one layer's share of a block standing at the trace's mean read
    index (here reads 0, 1 and 0, 1, 2: mean 0.8)."""
    path = tmp_path / "s.jsonl"
    records = [{"block_tokens": 16}, {"step": 0, "layer": 0, "read": [], "write": [0, 1]},
               {"step": 1, "layer": 0, "read": [0, 1], "write": []}, {"step": 2, "layer": 0, "read": [0, 1, 2], "write": []}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "r.json"
    assert main(["replay", str(path), "--policy", "lru", "--capacity", "1", "--layout",
                 "layers=2,kv_heads=8,head_dim=128,params=8030261248,heads=32", "--hardware", "h200-pcie5-nvme4",
                 "--out", str(out), "--no-progress"]) == 0
    run = json.loads(out.read_text())["runs"][0]
    mean, b = 0.8, 16.0
    block = (2.0 * P * b + 4.0 * 2.0 * 32.0 * 128.0 * b * (b * mean + (b + 1.0) / 2.0)) / F / 2.0
    assert run["modeled_seconds"]["recompute"] == pytest.approx(run["misses"] * block, abs=1e-6)
