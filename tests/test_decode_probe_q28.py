"""Probe q28, finding 1: a decode recorded on a cache reopened on a closed cache's path (it
adopts the blocks ``close()`` persisted) replays to the live run's counts: the recording
places the adopted blocks where they lie (its leading ``resident`` records), and the replay
puts them there, uncounted, before the first step."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from tiercache import AttentionMode, TieredKVCache
from tiercache.cli import main
from tiercache.config import KVLayout, TierConfig
from tiercache.errors import TraceError
from tiercache.live.traffic import as_replay_charges
from tiercache.sim.loader import load_trace
from tiercache.sim.tracestats import trace_stats

_FIELDS = ("hits", "inserts", "evictions", "demotions", "promotions", "copies", "refused", "promote_skipped", "lost",
           "hits_in_place", "in_place_bytes")


def _kv(layout: KVLayout, tokens: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (layout.kv_heads, tokens, layout.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _tiers() -> list[TierConfig]:
    return [TierConfig("hbm", 5), TierConfig("dram", 6), TierConfig("nvme", 60)]


def _replay(trace, out, tiers="hbm=5,dram=6,nvme=60") -> dict:
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["replay", str(trace), "--tiers", tiers, "--no-progress", "--workers", "1", "--out", str(out),
                     "--layout", "layers=2,kv_heads=2,head_dim=8,dtype=float32"])
    assert code == 0
    return json.loads(out.read_text())["runs"][0]


def test_a_decode_recorded_on_a_reopened_cache_replays_to_the_live_counts(tmp_path):
    layout = KVLayout(2, 2, 8, "float32", 4)
    g = torch.Generator().manual_seed(0)
    prompt = list(range(40))
    with TieredKVCache(layout, _tiers(), path=tmp_path / "nvme", device="cpu", prefetch="none") as first:
        seq = first.sequence(tokens=prompt)
        for layer in range(2):
            seq.append(layer, *_kv(layout, 40, g))
        seq.free()
    record = tmp_path / "second.jsonl"
    with TieredKVCache(layout, _tiers(), path=tmp_path / "nvme", device="cpu", prefetch="none", record=record) as second:
        seq = second.sequence(tokens=prompt + [7, 7, 7, 7])
        assert seq.cached_tokens == 40  # the whole stored prompt (4 more tokens to compute)
        adopted = sorted(second.manager.dirs[2].slot_of)
        for layer in range(2):
            seq.append(layer, *_kv(layout, 44 - seq.cached_tokens, g))
        for _ in range(4):
            for layer in range(2):
                seq.append(layer, *_kv(layout, 1, g))
                seq.attend(layer, torch.randn(4, 1, 8, generator=g), AttentionMode.EXACT)
        live = second.stats()
    assert live["misses"] == 0 and live["tiers"][2]["hits"] > 0
    trace = load_trace(record)
    placed = [fields.resident for fields in trace.steps.decode.values() if fields.resident]
    assert sorted(i for resident in placed for name, ids in resident for i in ids) == adopted
    replayed = _replay(record, tmp_path / "r.json")
    assert (replayed["hits"], replayed["misses"]) == (live["hits"], live["misses"])
    for live_tier, replay_tier in zip(live["tiers"], replayed["tiers"]):
        assert {f: live_tier[f] for f in _FIELDS} == {f: replay_tier[f] for f in _FIELDS}, live_tier["name"]
    assert {k: v for k, v in as_replay_charges(live).items() if v} == {k: v for k, v in replayed["bytes_moved"].items() if v}
    assert trace_stats(record).compulsory_miss_ratio == 0.0  # every block read was stored before the run
    late = tmp_path / "late.jsonl"  # only leading records place blocks: the replay places them before the first step
    late.write_text('{"step": 0, "layer": 0, "read": [], "write": [1]}\n'
                    '{"step": 0, "layer": 0, "read": [], "write": [], "resident": {"nvme": [2]}}\n')
    with pytest.raises(TraceError, match="late.jsonl:2: 'resident' is allowed only in the trace's leading records"):
        load_trace(late)
