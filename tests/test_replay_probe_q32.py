"""Probe Q32, finding 1 (the prefill cost model of ``tiercache replay``): a prefix lookup
reused, and charged the load of, a request's block that held only its last prompt token (or
none of its tokens), which the engine computes anyway (a request saves at most
``input_length - 1`` tokens). A request of 513 tokens found whole in NVMe paid two block
loads for one block's tokens (TTFT saved -0.0033 s); one of 1 token paid a load and saved
nothing. A lookup now stops at ``reusable_blocks`` (vLLM and SGLang match at most ``n - 1``
tokens): the blocks after it are recomputed and stored, never loaded, on the kernels, the
Python path and the fleet replay alike."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tiercache.sim.replay as replay_module
from tiercache.cli import main
from tiercache.config import TierConfig, layout_preset
from tiercache.sim.hardware import PRESETS
from tiercache.sim.loader import load_trace
from tiercache.sim.replay import ReplayData, RunSpec, Semantics, replay
from tiercache.sim.reuse import reusable_blocks
from tiercache.sim.traces import Request, write_requests

QUIET = ["--workers", "1", "--no-progress"]
MODELED = ["--model", "llama-3-8b", "--hardware", "h200-pcie5-nvme4", "--semantics", "prefix"]


def _write(path: Path, requests: list[tuple[int, list[int]]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": n, "input_length": length, "output_length": 1, "hash_ids": ids})
                            + "\n" for n, (length, ids) in enumerate(requests)))
    return path


def _run(tmp_path: Path, trace: Path, *argv: str) -> dict:
    out = tmp_path / "out.json"
    assert main(["replay", str(trace), "--policy", "lru", *MODELED, *QUIET, "--out", str(out), *argv]) == 0
    return json.loads(out.read_text())["runs"][0]


def test_reusable_blocks_holds_any_of_the_first_n_minus_1_tokens():
    assert [reusable_blocks(512, n) for n in (0, 1, 2, 512, 513, 514, 1024, 1025)] == [0, 0, 1, 1, 1, 2, 2, 2]


def test_a_block_holding_only_the_last_prompt_token_is_recomputed_not_loaded(tmp_path):
    trace = _write(tmp_path / "t.jsonl", [(513, [1, 2]), (512, [3]), (512, [4]), (513, [1, 2])])
    run = _run(tmp_path, trace, "--tiers", "hbm=1,nvme=8")
    nvme = next(t for t in run["tiers"] if t["name"] == "nvme")
    assert (run["hits"], nvme["hits"], run["prefill_tokens_saved"]) == (1, 1, 512)
    block = 64 * 2**20  # llama-3-8b: 512 tokens of 32 layers' K and V in bf16
    assert nvme["promoted_bytes"] == block  # block 1 loaded; block 2 (token 512 alone) recomputed
    assert run["ttft_saved_s"] > 0


def test_a_request_of_one_token_loads_nothing(tmp_path):
    trace = _write(tmp_path / "t.jsonl", [(1, [1, 2, 3]), (1, [1, 2, 3]), (1, [1, 2, 3])])
    run = _run(tmp_path, trace, "--tiers", "hbm=1,nvme=8")
    assert run["hits"] == 0 and run["prefill_tokens_saved"] == 0 and run["ttft_saved_s"] == 0
    assert all(not t["promoted_bytes"] and not t["in_place_bytes"] for t in run["tiers"])


def _edge_trace(path: Path, seed: int) -> str:
    """Requests over shared documents whose lengths often leave the last block one token (or
    none: more blocks than tokens fill), ids repeated inside some."""
    rng = np.random.default_rng(seed)
    docs = [list(range(1000 * d, 1000 * d + int(rng.integers(2, 30)))) for d in range(10)]
    requests = []
    for r in range(250):
        ids = docs[int(rng.zipf(1.5)) % len(docs)][: int(rng.integers(1, 30))]
        blocks = len(ids)
        length = int(rng.choice([512 * (blocks - 1) + 1, 512 * blocks, 512 * (blocks - 2) + 1, 1, 512 * blocks - 5]))
        requests.append(Request(r, max(length, 0), 2, tuple(ids)))
    name = str(path / f"edge{seed}.jsonl")
    write_requests(name, requests)
    return name


@pytest.mark.parametrize("policy", ["lru", "belady", "s3fifo"])
def test_the_kernels_and_the_python_path_stop_at_the_same_block(tmp_path, monkeypatch, policy):
    pytest.importorskip("numba", reason="the kernels need numba")
    data = ReplayData.prepare(load_trace(_edge_trace(tmp_path, 3)), layout_preset("llama-3-8b", 512),
                              PRESETS["h200-pcie5-nvme4"])
    spec = RunSpec(policy, Semantics.PREFIX, (TierConfig("hbm", 12), TierConfig("dram", 20), TierConfig("nvme", 40)))
    assert replay_module.use_kernels(spec)
    ours = replay(spec, data)
    with monkeypatch.context() as patched:
        patched.setattr(replay_module, "use_kernels", lambda spec: False)
        reference = replay(spec, data)
    assert ours.hits > 0
    assert (ours.hits, ours.misses, ours.prefill_tokens_saved) == (reference.hits, reference.misses,
                                                                    reference.prefill_tokens_saved)
    assert [(t.hits, t.promoted_bytes, t.in_place_bytes) for t in ours.tiers] == \
        [(t.hits, t.promoted_bytes, t.in_place_bytes) for t in reference.tiers]


def test_the_fleet_replay_stops_there_too(tmp_path):
    trace = _write(tmp_path / "t.jsonl", [(513, [1, 2]), (513, [1, 2]), (1, [1, 2])])
    out = tmp_path / "fleet.json"
    assert main(["replay", str(trace), "--instances", "1", "--tiers", "hbm=4,remote=8", "--policy", "lru", *MODELED, *QUIET,
                 "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["hits"] == 1 and run["prefill_tokens_saved"] == 512


def test_trace_inspect_gives_a_time_span_near_2_63_ms_exactly(tmp_path, capsys):
    """Finding 2: the span was divided as a float (9223372036854776.000 s)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}) + "\n"
                     + json.dumps({"timestamp": 2**63 - 1, "input_length": 512, "output_length": 1, "hash_ids": [1]}) + "\n")
    assert main(["trace", "inspect", str(trace)]) == 0
    assert "9223372036854775.807 s" in capsys.readouterr().out
