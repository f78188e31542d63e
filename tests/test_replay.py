"""`tiercache replay`: golden numbers against libCacheSim, Belady bound, results contract."""

from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import pytest

from conftest import DATA, SAMPLE_TRACE
from tiercache.cli import main
from tiercache.config import CacheConfig, layout_preset, parse_tiers
from tiercache.policies import EVICTION
from tiercache.results import SCHEMA_VERSION, Semantics
from tiercache.sim.hardware import load_profile
from tiercache.sim.loader import load_trace
from tiercache.sim.sweep import SweepSpec, run_sweep, sweep

CAPACITIES = [1000, 4000, 16000]
GOLDEN = DATA / "golden_libcachesim.json"
EXACT = ["lru", "fifo", "belady"]
CLOSE = ["arc", "s3fifo", "sieve"]


@pytest.fixture(scope="module")
def object_sweep() -> dict:
    return run_sweep(str(SAMPLE_TRACE), EXACT + CLOSE + ["lfu", "leaf_lru"], CAPACITIES, ["object"], workers=2, progress=False)


def typed_sweep(trace, policies, semantics, tiers=None, model=None, hardware=None) -> dict:
    """A sweep through the typed API (what the CLI builds from its options), as results.json's object."""
    layout = layout_preset(model, 512) if model else None
    cache = CacheConfig(parse_tiers(tiers, layout)) if tiers else None
    spec = SweepSpec(tuple(policies), tuple(Semantics.parse(s) for s in semantics), (), cache, layout=layout,
                     hardware=load_profile(hardware) if hardware else None)
    return sweep(load_trace(trace), spec).to_json()


def _golden() -> dict:
    if not GOLDEN.exists():
        pytest.skip("golden libCacheSim numbers not generated yet")
    return json.loads(GOLDEN.read_text())["miss_ratio"]


def _ratios(results: dict, semantics: str = "object") -> dict[tuple[str, int], float]:
    return {(r["policy"], r["capacity_blocks"]): r["miss_ratio"] for r in results["runs"] if r["semantics"] == semantics}


@pytest.mark.parametrize("policy", EXACT)
def test_exact_policies_equal_libcachesim_through_the_manager(object_sweep, policy):
    golden, ours = _golden(), _ratios(object_sweep)
    for cap in CAPACITIES:
        assert round(ours[(policy, cap)], 4) == round(golden[policy][str(cap)], 4), (policy, cap)


@pytest.mark.parametrize("policy", CLOSE)
def test_adaptive_policies_within_a_hundredth_of_libcachesim(object_sweep, policy):
    golden, ours = _golden(), _ratios(object_sweep)
    for cap in CAPACITIES:
        assert abs(ours[(policy, cap)] - golden[policy][str(cap)]) <= 0.01, (policy, cap)


def test_live_libcachesim_agrees_with_the_manager_for_lru(object_sweep, tmp_path):
    lcs = pytest.importorskip("libcachesim")
    from tiercache.sim.oracle import export_oracle_general

    path = tmp_path / "trace.oracleGeneral"
    export_oracle_general(str(SAMPLE_TRACE), str(path))
    ours = _ratios(object_sweep)
    for cap in CAPACITIES:
        reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
        theirs, _ = lcs.LRU(cache_size=cap).process_trace(reader)
        assert round(theirs, 4) == round(ours[("lru", cap)], 4)


@pytest.mark.parametrize("semantics", ["object", "prefix"])
def test_belady_is_a_lower_bound(semantics, object_sweep):
    if semantics == "object":
        results = object_sweep
    else:
        results = run_sweep(str(SAMPLE_TRACE), EXACT + CLOSE + ["lfu", "leaf_lru"], CAPACITIES, ["prefix"], workers=2, progress=False)
    ratios = _ratios(results, semantics)
    for cap in CAPACITIES:
        bound = ratios[("belady", cap)]
        assert all(v >= bound - 1e-12 for (p, c), v in ratios.items() if c == cap), cap


def test_results_document_contract(tmp_path, capsys):
    out = tmp_path / "results.json"
    code = main([
        "replay", str(DATA / "mooncake_head.jsonl"), "--policy", "lru,fifo", "--capacity", "100,400",
        "--semantics", "object,prefix", "--model", "llama-3-8b", "--hardware", "h200-pcie5-nvme4",
        "--out", str(out), "--no-progress", "--workers", "1",
    ])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["trace"]["fingerprint"] and doc["layout"]["block_bytes"] == 512 * 128 * 1024
    assert len(doc["runs"]) == 8
    for run in doc["runs"]:
        for key in ("policy", "semantics", "capacity_blocks", "accesses", "hits", "misses", "miss_ratio", "tiers"):
            assert key in run
        assert run["hits"] + run["misses"] == run["accesses"]
        assert run["tiers"][0]["name"] == "hbm" and run["tiers"][0]["hits"] == run["hits"]
        assert "modeled_seconds" in run and "bytes_moved" in run
    prefix = [r for r in doc["runs"] if r["semantics"] == "prefix"]
    assert all(r["prefill_tokens_saved"] > 0 and "ttft_saved_s" in r for r in prefix)
    assert "miss ratio" in capsys.readouterr().out


def test_hierarchy_run_reports_every_tier_and_link_bytes(tmp_path):
    doc = typed_sweep(str(DATA / "mooncake_head.jsonl"), ["lru"], ["object"], tiers="hbm=50,dram=200,nvme=800",
                      model="llama-3-8b", hardware="h200-pcie5-nvme4")
    (run,) = doc["runs"]
    assert [t["name"] for t in run["tiers"]] == ["hbm", "dram", "nvme"]
    assert sum(t["hits"] for t in run["tiers"]) == run["hits"]
    assert run["bytes_moved"]["hbm->dram"] > 0 and run["modeled_seconds"]["total"] > 0
    assert run["capacity_blocks"] == 1050 and run["mode"] == "exclusive"


def _error(argv, capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--capacity", "0"], "--capacity"),
        (["--capacity", "-5"], "--capacity"),
        (["--capacity", "abc"], "--capacity"),
        (["--policy", "nope"], "unknown eviction policy 'nope'"),
        (["--policy", "os:path"], "'os:path' is not a subclass of EvictionPolicy"),
        (["--policy", "os:sep"], "'os:sep' is not a subclass of EvictionPolicy"),
        (["--admission", "tiercache.policies.lru:LRU"], "not a subclass of AdmissionPolicy"),
        (["--model", "gpt-17"], "unknown model preset"),
        (["--model", "llama-3-8b", "--hardware", "warp-drive"], "warp-drive"),
        (["--semantics", "sideways"], "--semantics"),
        (["--tiers", "hbm=0"], "--tiers hbm"),
        (["--tiers", "l4=10"], "unknown tier"),
        (["--tiers", "hbm=10,hbm=5"], "--tiers"),
        (["--tiers", "dram=5,hbm=10"], "fastest first"),
        (["--tiers", "hbm=10", "--capacity", "5"], "--capacity and --tiers are exclusive"),
        (["--tiers", "hbm=10", "--capacity", "4000"], "--capacity and --tiers are exclusive"),
        (["--model", "llama-3-8b", "--layout", "layers=2,kv_heads=1,head_dim=8"], "exclusive"),
        (["--layout", "layers=2,kv_heads=1"], "--layout"),
        (["--hardware", "h200-pcie5-nvme4"], "--hardware needs"),
    ],
)
def test_bad_options_exit_cleanly(extra, needle, capsys):
    err = _error(["replay", str(DATA / "mooncake_head.jsonl"), "--no-progress", *extra], capsys)
    assert needle in err


@pytest.mark.parametrize(
    "content, needle",
    [
        ("", "empty"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]}\n{not json\n', ":2"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n', "hash_ids"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "x"]}\n', ":1"),
    ],
)
def test_bad_traces_name_file_and_line(tmp_path, content, needle, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    err = _error(["replay", str(path), "--no-progress"], capsys)
    assert "bad.jsonl" in err and needle in err


def test_missing_trace_file(tmp_path, capsys):
    err = _error(["replay", str(tmp_path / "nope.jsonl"), "--no-progress"], capsys)
    assert "nope.jsonl" in err


def test_bundled_example_is_a_slice_of_the_sample(sample_trace):
    head = Path(DATA / "mooncake_head.jsonl").read_text().splitlines()
    full = Path(sample_trace).read_text().splitlines()
    assert head == full[: len(head)]


@pytest.fixture(scope="module")
def step_trace(tmp_path_factory) -> Path:
    from tiercache.sim.steptrace import write_steps
    from tiercache.sim.synth import ScanSpec, scan_trace

    path = tmp_path_factory.mktemp("steps") / "scan.jsonl"
    write_steps(path, scan_trace(ScanSpec(steps=120, prompt_blocks=4, block_tokens=8, layers=2)))
    return path


@pytest.mark.parametrize("policy", sorted(EVICTION))
def test_step_trace_replays_with_every_eviction_policy(step_trace, policy, capsys):
    for tiers in (["--capacity", "6"], ["--tiers", "hbm=4,dram=4"]):
        code = main(["replay", str(step_trace), "--policy", policy, *tiers, "--no-progress", "--workers", "1"])
        captured = capsys.readouterr()
        assert code == 0 and "Traceback" not in captured.err, captured.err
        assert "decode" in captured.out


@pytest.mark.parametrize("where", ["missing/r.json", "folder"])
def test_replay_out_is_checked_before_the_sweep(tmp_path, where, capsys, monkeypatch):
    (tmp_path / "folder").mkdir()
    out = tmp_path / where
    monkeypatch.setattr("tiercache.cli.replay.sweep_from_args", lambda args: pytest.fail("the sweep ran"))
    err = _error(["replay", str(DATA / "mooncake_head.jsonl"), "--no-progress", "--out", str(out)], capsys)
    assert f"--out {out}" in err


def test_compare_out_under_a_file_is_checked_before_the_sweep(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "report"
    monkeypatch.setattr("tiercache.cli.report.traced_sweep_from_args", lambda args: pytest.fail("the sweep ran"))
    err = _error(["compare", str(DATA / "mooncake_head.jsonl"), "--no-progress", "-o", str(out)], capsys)
    assert f"-o {out}" in err


def test_custom_layout_equals_its_preset(tmp_path, capsys):
    trace, spec = str(DATA / "mooncake_head.jsonl"), "layers=32,kv_heads=8,head_dim=128,dtype=bfloat16,params=8030261248,heads=32"
    docs = []
    for name, option in (("preset", ["--model", "llama-3-8b"]), ("custom", ["--layout", spec])):
        out = tmp_path / f"{name}.json"
        argv = ["replay", trace, "--policy", "lru", "--semantics", "prefix", "--tiers", "hbm=2GiB,dram=8GiB", *option,
                "--hardware", "h200-pcie5-nvme4", "--workers", "1", "--no-progress", "--out", str(out)]
        assert main(argv) == 0, capsys.readouterr().err
        docs.append(json.loads(out.read_text()))
    preset, custom = docs
    assert custom["layout"]["block_bytes"] == preset["layout"]["block_bytes"] == 512 * 128 * 1024
    drop = ("wall_seconds",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in custom["runs"]] == \
           [{k: v for k, v in r.items() if k not in drop} for r in preset["runs"]]
    assert custom["runs"][0]["capacity_blocks"] == 32 + 128


def test_layout_option_on_the_command_line(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["replay", str(DATA / "mooncake_head.jsonl"), "--layout", "layers=2,kv_heads=1,head_dim=8",
            "--tiers", "hbm=64KiB", "--no-progress", "--workers", "1", "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["layout"]["block_bytes"] == 2 * 2 * 1 * 8 * 512 * 2 and doc["runs"][0]["capacity_blocks"] == 2


def test_ttft_saved_counts_only_loads_not_write_backs():
    # Without query heads prefill is weights only, a flat rate: saved tokens / rate = TTFT saved + loads.
    layout = dataclasses.replace(layout_preset("llama-3-8b", 512), heads=None)
    spec = SweepSpec(("lru",), (Semantics.PREFIX,), (), CacheConfig(parse_tiers("hbm=100,dram=200", layout)), layout=layout,
                     hardware=load_profile("h200-pcie5-nvme4"))
    doc = sweep(load_trace(str(DATA / "mooncake_head.jsonl")), spec).to_json()
    (run,) = doc["runs"]
    assert run["tiers"][0]["demotions"] > 0 and run["modeled_seconds"]["hbm->dram"] > 0
    assert run["ttft_saved_s"] > 0
    rate = run["prefill_tokens_saved"] / (run["ttft_saved_s"] + run["modeled_seconds"]["dram->hbm"])
    assert rate == pytest.approx(doc_rate(doc), rel=1e-4)


def doc_rate(doc: dict) -> float:
    return load_profile(doc["hardware"]).prefill_tokens_per_s


def test_semantics_is_an_enum_and_results_keep_the_plain_string():
    from tiercache.errors import UserError
    from tiercache.results import TraceKind
    from tiercache.sim.sweep import plan_runs

    spec = SweepSpec(("lru",), (Semantics.OBJECT, Semantics.PREFIX), (10,))
    runs = plan_runs(spec, TraceKind.REQUESTS)
    assert [r.semantics for r in runs] == [Semantics.OBJECT, Semantics.PREFIX]
    assert [r.semantics for r in plan_runs(spec, TraceKind.STEPS)] == [Semantics.DECODE]  # a real member, not a string
    with pytest.raises(UserError, match="known: object, prefix"):
        Semantics.parse("sideways")
    with pytest.raises(UserError, match="--semantics"):
        SweepSpec(("lru",), (Semantics.DECODE,), (10,))
    doc = run_sweep(str(DATA / "mooncake_head.jsonl"), ["lru"], [50], ["prefix"], workers=1, progress=False)
    assert type(doc["runs"][0]["semantics"]) is str and doc["runs"][0]["semantics"] == "prefix"
    assert json.loads(json.dumps(doc))["runs"][0]["prefill_tokens_saved"] > 0


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"policies": ()}, "--policy"),
        ({"policies": ("nope",)}, "unknown eviction policy"),
        ({"admission": "nope"}, "nope"),
        ({"capacities": (0,)}, "--capacity"),
        ({"capacities": ()}, "--capacity"),
        ({"capacities": (5,), "cache": CacheConfig(parse_tiers("hbm=4", None))}, "exclusive"),
        ({"hardware": load_profile("h200-pcie5-nvme4")}, "--hardware needs"),
    ],
)
def test_sweep_spec_is_validated_when_built(kwargs, needle):
    from tiercache.errors import UserError

    fields = {"policies": ("lru",), "semantics": (Semantics.OBJECT,), "capacities": (10,)} | kwargs
    with pytest.raises(UserError, match=needle):
        SweepSpec(**fields)


def test_step_trace_results_say_decode_and_count_every_counter(step_trace, tmp_path):
    out = tmp_path / "r.json"
    assert main(["replay", str(step_trace), "--capacity", "6", "--no-progress", "--workers", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema_version"] == SCHEMA_VERSION and doc["trace"]["kind"] == "steps"
    (run,) = doc["runs"]  # a step trace replays once, in decode semantics
    assert run["semantics"] == "decode" and run["recomputed"] == 0
    assert {"failed_transfers", "promote_skipped", "lost"} <= set(run["tiers"][0])


def test_recorded_command_is_the_argv_given_to_main(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["pytest", "--something-else"])
    out = tmp_path / "r.json"
    argv = ["replay", str(DATA / "mooncake_head.jsonl"), "--capacity", "50", "--no-progress", "--workers", "1", "--out", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["command"] == "tiercache " + " ".join(argv)
