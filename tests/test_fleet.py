"""Fleet replay (issue 11, item 6): N instances with private tiers plus one shared remote tier,
run by ``tiercache replay --instances N --tiers ...,remote=CAP`` and shown by ``tiercache report``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiercache.cli import main
from tiercache.config import TierConfig
from tiercache.results import SCHEMA_VERSION, read_results
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
    first, second = shared.instances
    assert (first.requests, second.requests) == (2, 1)
    assert second.tier_hits == {"hbm": 0, "remote": 3} and second.misses == 1  # 1, 2, 3 from the store
    assert first.tier_hits == {"hbm": 2, "remote": 0}  # request 3: 1, 2 still local
    assert [t.name for t in shared.tiers] == ["hbm", "remote"] and shared.shared_hits == 3
    assert shared.tiers[1].hits_promoted == 3 and shared.tiers[1].capacity_blocks == 16  # promoted into HBM
    private = replay_fleet(spec, trace, shared=False)
    assert private.instances[1].hits == 0 and private.hits == 2 and private.shared_writes is None
    assert shared.shared_writes == 5  # 1..5, each written once
    assert shared.prefill_tokens_saved == 512 * 5 and shared.prefill_tokens == 512 * 10


def test_prefix_affinity_routes_shared_prefixes_to_one_instance(tmp_path):
    trace = _trace(tmp_path, [[7, 8], [7, 8, 9], [7, 10]])
    result = replay_fleet(FleetSpec(3, (TierConfig("hbm", 8),), 0, Route.PREFIX_AFFINITY), trace)
    assert sorted(r.requests for r in result.instances) == [0, 0, 3]
    assert result.hits == 3 and result.shared_hits == 0 and result.shared_writes is None
    assert result.route is Route.PREFIX_AFFINITY and len(result.tiers) == 1


def test_the_shared_tier_turns_misses_into_shared_hits_and_changes_no_local_hit():
    trace = load_trace(HEAD)
    spec = FleetSpec(4, (TierConfig("hbm", 100), TierConfig("dram", 300)), 2000, Route.ROUND_ROBIN)
    shared, private = replay_fleet(spec, trace), replay_fleet(spec, trace, shared=False)
    assert shared.accesses == private.accesses == len(trace.ids)
    assert sum(r.requests for r in shared.instances) == trace.records
    for with_tier, alone in zip(shared.instances, private.instances):
        # every block of a request ends in HBM either way (promoted or recomputed), so the
        # local tiers evolve identically: the shared tier only turns misses into its hits
        assert {t: with_tier.tier_hits[t] for t in ("hbm", "dram")} == alone.tier_hits
        assert with_tier.hits == alone.hits + with_tier.shared_hits
    assert shared.shared_hits > 0
    for tier in shared.tiers:  # the run's tiers are the instances' counters summed
        assert tier.hits == sum(i.tier_hits[tier.name] for i in shared.instances)


def test_network_presets_model_remote_loads_and_ttft_saved(tmp_path):
    from tiercache.config import layout_preset
    from tiercache.sim.hardware import NETWORK_PRESETS, PRESETS, with_network

    trace = _trace(tmp_path, [[1, 2, 3], [1, 2, 3, 4]])
    layout = layout_preset("llama-3-8b", block_tokens=512)
    spec = FleetSpec(2, (TierConfig("hbm", 8),), 16, Route.ROUND_ROBIN)
    for network in ("tcp-25g", "rdma-400g"):
        profile = with_network(PRESETS["h200-pcie5-nvme4"], network)
        second = replay_fleet(spec, trace, layout, profile=profile).instances[1]
        link = NETWORK_PRESETS[network]
        nbytes = 3 * layout.block_bytes  # blocks 1, 2, 3 read from the store: remote -> dram -> hbm, staged
        expected_load = link.seconds(nbytes) + profile.links["dram->hbm"].seconds(nbytes)
        assert abs(second.modeled_seconds["remote->hbm"] - expected_load) < 1e-6  # results round to microseconds
        assert second.bytes_moved["remote->hbm"] == nbytes
        # prefill of the saved tokens [0, 1536): weights plus attention (llama-3-8b: 32 layers, 32 heads of 128)
        flops = 2 * layout.params * 1536 + 4 * 32 * 32 * 128 * 1536 * 1537 / 2
        saved = flops / (profile.prefill_tokens_per_s * 2 * layout.params) - expected_load
        assert abs(second.ttft_saved_s - saved) < 1e-6  # over 25 Gb/s TCP recompute is faster: negative
        assert (saved < 0) == (network == "tcp-25g")


# ----------------------------------------------------------------------------- the command

FLEET = ["replay", str(HEAD), "--instances", "4", "--tiers", "hbm=100,dram=300,remote=2000", "--no-progress"]


def test_replay_with_instances_prints_hits_and_writes_a_results_file_the_report_reads(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    assert main(FLEET + ["--model", "llama-3-8b", "--hardware", "h200-pcie5-nvme4", "--network", "rdma-400g",
                         "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "remote hits" in printed and "private tiers alone" in printed and "remote->hbm" in printed
    document = read_results(out)
    shared, private = document.runs
    assert len(shared.instances) == 4 and shared.shared_hits > 0 and shared.route is Route.ROUND_ROBIN
    assert [t.name for t in private.tiers] == ["hbm", "dram"] and private.instances is not None
    assert document.hardware == "h200-pcie5-nvme4+rdma-400g" and document.layout.name == "llama-3-8b"
    row = next(line.split() for line in printed.splitlines() if line.split()[:1] == ["all"])
    assert row[2:6] == [str(t.hits) for t in shared.tiers] + [str(shared.misses)]  # printed = recorded
    assert json.loads(out.read_text())["schema_version"] == SCHEMA_VERSION
    assert main(["report", str(out), "-o", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Fleet replay: per-instance and shared-tier hits" in report
    assert "| instance | requests | hbm hits | dram hits | remote hits |" in report
    per_instance = f"| 0 | {shared.instances[0].requests} | {shared.instances[0].tier_hits['hbm']} |"
    assert per_instance in report and f"serves {shared.shared_hits} hits" in report and "remote->hbm GiB" in report
    assert (tmp_path / "report" / "fleet_1.png").stat().st_size > 1000
    header = (tmp_path / "report" / "results.csv").read_text().splitlines()[0].split(",")
    assert {"instances", "route", "shared_writes", "remote_hits"} <= set(header)


def test_a_remote_tier_without_instances_is_one_engine_with_a_remote_tier(tmp_path, capsys):
    out = tmp_path / "one.json"
    assert main(["replay", str(HEAD), "--tiers", "hbm=100,remote=2000", "--policy", "lru,fifo", "--out", str(out)]) == 0
    runs = read_results(out).runs
    assert [(r.policy, len(r.instances), [t.name for t in r.tiers]) for r in runs] == [
        ("lru", 1, ["hbm", "remote"]), ("lru", 1, ["hbm"]), ("fifo", 1, ["hbm", "remote"]), ("fifo", 1, ["hbm"])]
    # one engine writes all it computes to the remote tier and finds there what its HBM lost
    assert runs[0].hits >= runs[1].hits and "1 instance(s)" in capsys.readouterr().out


def test_a_report_merges_fleet_runs_with_one_engine_runs_of_the_same_trace(tmp_path, capsys):
    fleet, single = tmp_path / "fleet.json", tmp_path / "single.json"
    assert main(FLEET + ["--out", str(fleet)]) == 0
    assert main(["replay", str(HEAD), "--tiers", "hbm=100,dram=300", "--semantics", "prefix", "--no-progress",
                 "--out", str(single)]) == 0
    assert main(["report", str(fleet), str(single), "-o", str(tmp_path / "r")]) == 0
    report = (tmp_path / "r" / "report.md").read_text()
    assert "## Fleet replay" in report and "## Per-tier hits" in report and "4 instances (round\\_robin)" in report


def _error(capsys, *argv) -> str:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # an argparse error
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv, fragment", [
    (["--instances", "4", "--tiers", "hbm=100,dram=300"], "--instances 4: the instances of a fleet replay share a remote tier"),
    (["--instances", "4"], "add remote=CAP to --tiers"),
    (["--instances", "0", "--tiers", "hbm=100,remote=500"], "--instances: must be at least 1, got 0"),
    (["--tiers", "hbm=100,remote=500,dram=300"], "remote=CAP must be given once, as the last tier"),
    (["--tiers", "remote=500"], "need private tiers before remote"),
    (["--tiers", "hbm=100,remote=500:int4"], "--tiers remote=500:int4: the shared tier stores blocks as given"),
    (["--tiers", "hbm=100,dram=300:int8,remote=500"], "does not model quantised tiers (dram)"),
    (["--tiers", "hbm=100,remote=500", "--semantics", "object"], "--semantics object: does not apply to a fleet replay"),
    (["--tiers", "hbm=100,dram=300,remote=500", "--write-through"], "--write-through: does not apply to a fleet replay"),
    (["--tiers", "hbm=100,remote=500", "--policy", "belady"], "--policy belady: belady reads the future"),
    (["--tiers", "hbm=100,remote=500", "--capacity", "100"], "--capacity and --tiers are exclusive"),
    (["--tiers", "hbm=100,remote=500", "--network", "rdma-200g"], "--network rdma-200g: models the shared tier's links"),
    (["--tiers", "hbm=100,remote=500", "--hardware", "h200-pcie5-nvme4"], "--hardware needs --model or --layout"),
    (["--tiers", "hbm=100,remote=8GiB"], "--tiers remote"),
    (["--route", "prefix_affinity"], "--route prefix_affinity: applies to a fleet replay"),
    (["--tiers", "hbm=100", "--network", "tcp-25g"], "--network tcp-25g: applies to a fleet replay"),
])
def test_bad_fleet_options_name_the_option(capsys, argv, fragment):
    assert fragment in _error(capsys, "replay", HEAD, "--no-progress", *argv)


def test_a_step_trace_is_refused_naming_the_fleet_options(tmp_path, capsys):
    steps = tmp_path / "steps.jsonl"
    steps.write_text('{"block_tokens": 16}\n{"step": 0, "layer": 0, "read": [], "write": [1]}\n'
                     '{"step": 1, "layer": 0, "read": [1], "write": []}\n')
    err = _error(capsys, "replay", steps, "--instances", "2", "--tiers", "hbm=10,remote=50")
    assert "is a step trace; a fleet replay (--instances, remote=CAP in --tiers) replays request traces" in err


def test_compare_refuses_a_remote_tier(capsys, tmp_path):
    err = _error(capsys, "compare", HEAD, "--tiers", "hbm=100,remote=500", "-o", tmp_path / "c", "--no-progress")
    assert "a shared remote tier is replayed by tiercache replay" in err


def test_a_fleet_without_private_hits_states_no_infinite_gain(tmp_path, capsys):
    """Every block is requested by one instance and again by another: the private tiers hit
    nothing, so the gain sentence gives no percentage (it printed "+inf%")."""
    path = tmp_path / "cross.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 512, "output_length": 1, "hash_ids": [t // 2]}) + "\n"
                            for t in range(8)))
    assert main(["replay", str(path), "--tiers", "hbm=4,remote=16", "--instances", "2", "--semantics", "prefix",
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "inf%" not in printed and "no private hits to compare with" in printed


@pytest.mark.parametrize("policy", ["lru", "leaf_lru", "session", "cost"])
def test_one_private_instance_replays_as_tiercache_replay_does(policy):
    """Review R33: the fleet gave a request's blocks no parents, so leaf_lru, session and
    cost ranked every block as a root there: one private instance counted other hits than
    the same replay without a fleet."""
    from tiercache.sim.sweep import run_sweep

    spec = FleetSpec(1, (TierConfig("hbm", 40), TierConfig("dram", 120)), 0, Route.ROUND_ROBIN, policy=policy)
    fleet = replay_fleet(spec, load_trace(HEAD), shared=False)
    alone = run_sweep(str(HEAD), [policy], [], ["prefix"], tiers="hbm=40,dram=120", workers=1, progress=False)["runs"][0]
    assert ([t.hits for t in fleet.tiers], fleet.misses) == ([t["hits"] for t in alone["tiers"]], alone["misses"])
