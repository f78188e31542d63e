"""Fleet replay (issue 11): N instances with private tiers plus one shared remote tier."""

from __future__ import annotations

import json
from pathlib import Path

from tiercache.cli import main
from tiercache.config import TierConfig
from tiercache.sim.fleet import FleetSpec, Route, replay_fleet
from tiercache.sim.loader import load_trace

HEAD = Path(__file__).parent / "data" / "mooncake_head.jsonl"


def _trace(tmp_path: Path, requests: list[list[int]]):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(r), "output_length": 1, "hash_ids": r}) + "\n"
                            for i, r in enumerate(requests)))
    return load_trace(path)


def test_a_prefix_computed_by_one_instance_is_a_shared_hit_on_another(tmp_path):
    trace = _trace(tmp_path, [[1, 2, 3], [1, 2, 3, 4], [1, 2, 5]])
    spec = FleetSpec(2, (TierConfig("hbm", 8),), 16, Route.ROUND_ROBIN)
    shared = replay_fleet(spec, trace)
    first, second = shared["instances"]
    assert (first["requests"], second["requests"]) == (2, 1)
    assert second["tier_hits"] == {"hbm": 0, "remote": 3} and second["misses"] == 1  # 1, 2, 3 from the store
    assert first["tier_hits"] == {"hbm": 2, "remote": 0}  # request 3: 1, 2 still local
    private = replay_fleet(spec, trace, shared=False)
    assert private["instances"][1]["hits"] == 0 and private["hits"] == 2
    assert shared["store"]["writes"] == 5  # 1..5, each written once


def test_prefix_affinity_routes_shared_prefixes_to_one_instance(tmp_path):
    trace = _trace(tmp_path, [[7, 8], [7, 8, 9], [7, 10]])
    result = replay_fleet(FleetSpec(3, (TierConfig("hbm", 8),), 0, Route.PREFIX_AFFINITY), trace)
    assert sorted(r["requests"] for r in result["instances"]) == [0, 0, 3]
    assert result["hits"] == 3 and result["shared_hits"] == 0 and result["store"] is None


def test_the_shared_tier_turns_misses_into_shared_hits_and_changes_no_local_hit():
    trace = load_trace(HEAD)
    spec = FleetSpec(4, (TierConfig("hbm", 100), TierConfig("dram", 300)), 2000, Route.ROUND_ROBIN)
    shared, private = replay_fleet(spec, trace), replay_fleet(spec, trace, shared=False)
    assert shared["accesses"] == private["accesses"] == len(trace.ids)
    assert sum(r["requests"] for r in shared["instances"]) == trace.records
    for with_tier, alone in zip(shared["instances"], private["instances"]):
        # every block of a request ends in HBM either way (promoted or recomputed), so the
        # local tiers evolve identically: the shared tier only turns misses into its hits
        assert {t: with_tier["tier_hits"][t] for t in ("hbm", "dram")} == alone["tier_hits"]
        assert with_tier["hits"] == alone["hits"] + with_tier["shared_hits"]
    assert shared["shared_hits"] > 0


def test_fleet_command_prints_per_instance_and_shared_hits_and_writes_a_report(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    code = main(["fleet", str(HEAD), "--instances", "4", "--tiers", "hbm=100,dram=300", "--remote", "2000",
                 "--model", "llama-3-8b", "--json", str(out), "--report", str(tmp_path / "report")])
    printed = capsys.readouterr().out
    assert code == 0 and "remote hits" in printed and "private tiers alone" in printed and "remote->hbm" in printed
    result = json.loads(out.read_text())
    assert len(result["shared"]["instances"]) == 4 and result["shared"]["shared_hits"] > 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## With the shared tier" in report and "| all |" in report and (tmp_path / "report" / "fleet.png").stat().st_size > 1000


def test_network_presets_model_remote_loads_and_ttft_saved(tmp_path):
    from tiercache.config import layout_preset
    from tiercache.sim.hardware import NETWORK_PRESETS, PRESETS, with_network

    trace = _trace(tmp_path, [[1, 2, 3], [1, 2, 3, 4]])
    layout = layout_preset("llama-3-8b", block_tokens=512)
    spec = FleetSpec(2, (TierConfig("hbm", 8),), 16, Route.ROUND_ROBIN)
    for network in ("tcp-25g", "rdma-400g"):
        profile = with_network(PRESETS["h200-pcie5-nvme4"], network)
        second = replay_fleet(spec, trace, layout, profile=profile)["instances"][1]
        link = NETWORK_PRESETS[network]
        nbytes = 3 * layout.block_bytes  # blocks 1, 2, 3 read from the store: remote -> dram -> hbm, staged
        expected_load = link.seconds(nbytes) + profile.links["dram->hbm"].seconds(nbytes)
        assert abs(second["link_seconds"]["remote->hbm"] - expected_load) < 1e-6  # results round to microseconds
        saved = 3 * 512 / profile.prefill_tokens_per_s - expected_load
        assert abs(second["ttft_saved_s"] - saved) < 1e-6  # over 25 Gb/s TCP recompute is faster: negative
        assert (saved < 0) == (network == "tcp-25g")
