"""Probe M, findings 2 and 3.

2. A hierarchy whose top tier is not HBM (``--tiers nvme=N``, ``dram=A,nvme=B``) was costed as
   if its top tier were HBM: every top-tier hit free, promotions charged only up to the top
   tier. Attention runs on the GPU, so a block must reach HBM to be used: a top-tier hit that
   is not in HBM is read on its link to HBM, a promoted hit goes on from the top tier to HBM,
   and a computed block is written from HBM into the tier storing it, alike in the compiled
   and the Python replay.
3. ``report`` named an out-of-tree offline policy the best online policy where its module
   did not import: results.json (schema 8) now records each run's ``offline`` flag, and the
   report uses it (older files: the registry, then the names belady/min/opt).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from tiercache.cli import main
from tiercache.config import TierConfig, layout_preset
from tiercache.errors import UserError
from tiercache.report.summary import best_per_capacity, is_offline
from tiercache.results import ResultsDocument, Semantics, read_results
from tiercache.sim import replay as replay_module
from tiercache.sim.engine import GPU, SimEngine
from tiercache.sim.hardware import PRESETS
from tiercache.sim.loader import load_trace
from tiercache.sim.replay import ReplayData, RunSpec, replay
from tiercache.sim.traces import Request, write_requests

LAYOUT = "layers=32,kv_heads=8,head_dim=128,dtype=bfloat16"
BLOCK_BYTES = 2 * 32 * 8 * 128 * 2 * 512
HARDWARE = "h200-pcie5-nvme4"


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    """Requests over a few shared prefixes (so hits land in every tier) plus fresh blocks."""
    requests, fresh = [], 10_000
    for r in range(120):
        doc = (r * r) % 7 % 5  # docs 0, 1 and 4 popular, 2 and 3 rarer
        ids = tuple(range(100 * doc, 100 * doc + 3 + doc)) + (fresh, fresh + 1)
        fresh += 2
        requests.append(Request(r, 512 * len(ids), 4, ids))
    path = tmp_path_factory.mktemp("probe_m") / "t.jsonl"
    write_requests(path, requests)
    return str(path)


def _replay(trace: str, tiers: str, out, *extra: str) -> dict:
    assert main(["replay", trace, "--tiers", tiers, "--layout", LAYOUT, "--hardware", HARDWARE, "--semantics", "prefix",
                 "--no-progress", "--workers", "1", "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


# -- finding 2: a top tier that is not HBM ---------------------------------------------------------------------------
def test_engine_reads_hits_to_hbm_and_writes_computed_blocks_from_it_when_the_top_is_not_hbm():
    profile = PRESETS[HARDWARE]
    engine = SimEngine(("dram", "nvme"), BLOCK_BYTES, profile)
    engine.read_through(0, 2)
    engine.read_through(1, 1)  # staged through DRAM, booked on its own name
    engine.fill(0, [7, 8, 9], None)
    assert {link: (u.blocks, u.bytes) for link, u in engine.usage.items()} == {
        "dram->hbm": (2, 2 * BLOCK_BYTES), "nvme->hbm": (1, BLOCK_BYTES), "hbm->dram": (3, 3 * BLOCK_BYTES)}
    assert engine.cost(1, GPU, 1)[1] == pytest.approx(profile.seconds("nvme->dram", BLOCK_BYTES)
                                                      + profile.seconds("dram->hbm", BLOCK_BYTES))
    top = SimEngine(("hbm", "dram"), BLOCK_BYTES, profile)
    top.fill(0, [1], None)  # computed in HBM, stored there: nothing crosses
    assert top.usage == {} and top.cost(1, GPU, 1) == top.cost(1, 0, 1)


def test_an_nvme_only_cache_pays_for_every_hit_and_saves_less_than_hbm(trace, tmp_path):
    hbm = _replay(trace, "hbm=40", tmp_path / "hbm.json")["runs"][0]
    nvme = _replay(trace, "nvme=40", tmp_path / "nvme.json")["runs"][0]
    (tier,) = nvme["tiers"]
    assert tier["hits"] == hbm["tiers"][0]["hits"] > 0
    assert tier["hits_in_place"] == tier["hits"] and tier["in_place_bytes"] == tier["hits"] * BLOCK_BYTES
    assert tier["in_place_seconds"] > 0
    assert nvme["bytes_moved"]["nvme->hbm"] == tier["hits"] * BLOCK_BYTES
    assert nvme["bytes_moved"]["hbm->nvme"] == tier["inserts"] * BLOCK_BYTES  # computed in HBM, written to the drive
    loads = nvme["modeled_seconds"]["nvme->hbm"]
    rate = PRESETS[HARDWARE].prefill_tokens_per_s
    assert nvme["ttft_saved_s"] == pytest.approx(nvme["prefill_tokens_saved"] / rate - loads, abs=2e-6)
    assert nvme["ttft_saved_s"] < hbm["ttft_saved_s"] and hbm["bytes_moved"] == {}


def test_a_dram_top_hierarchy_carries_every_hit_on_to_hbm(trace, tmp_path):
    run = _replay(trace, "dram=12,nvme=40", tmp_path / "dn.json")["runs"][0]
    dram, nvme = run["tiers"]
    assert dram["hits"] > 0 and nvme["hits_promoted"] > 0
    assert dram["in_place_bytes"] == dram["hits"] * BLOCK_BYTES and dram["in_place_seconds"] > 0
    # A promoted NVMe hit lands in DRAM, then goes on to HBM: both hops in its seconds.
    profile = PRESETS[HARDWARE]
    per_hop = (profile.links["nvme->dram"].seconds(BLOCK_BYTES * nvme["hits_promoted"], 0)
               + profile.links["dram->hbm"].seconds(BLOCK_BYTES * nvme["hits_promoted"], 0))
    assert nvme["promoted_seconds"] > per_hop
    onward = dram["hits"] + nvme["hits_promoted"]
    assert run["bytes_moved"]["dram->hbm"] == onward * BLOCK_BYTES
    assert run["bytes_moved"].get("nvme->hbm", 0) == nvme["hits_in_place"] * BLOCK_BYTES


@pytest.mark.parametrize("policy", ["lru", "belady", "arc"])
@pytest.mark.parametrize("semantics", [Semantics.OBJECT, Semantics.PREFIX])
@pytest.mark.parametrize("tiers", [(("nvme", 30),), (("dram", 8), ("nvme", 30)), (("dram", 4), ("nvme", 3))])
def test_compiled_and_python_replays_cost_a_top_tier_without_hbm_alike(trace, monkeypatch, policy, semantics, tiers):
    pytest.importorskip("numba")
    spec = RunSpec(policy, semantics, tuple(TierConfig(name, cap) for name, cap in tiers))
    data = ReplayData.prepare(load_trace(trace), layout_preset("llama-3-8b", 512), PRESETS[HARDWARE])
    assert replay_module.use_kernels(spec)
    compiled = replay(spec, data)
    with monkeypatch.context() as patched:
        patched.setattr(replay_module, "use_kernels", lambda spec: False)
        python = replay(spec, data)

    def figures(record) -> dict:
        doc = dataclasses.asdict(record)
        doc.pop("wall_seconds")
        seconds = {k: round(v, 4) for k, v in doc.pop("modeled_seconds").items()}
        for tier in doc["tiers"]:
            tier["in_place_seconds"] = round(tier["in_place_seconds"], 4)
            tier["promoted_seconds"] = round(tier["promoted_seconds"], 4)
        return doc | {"modeled_seconds": seconds, "ttft_saved_s": None if doc["ttft_saved_s"] is None else round(doc["ttft_saved_s"], 4)}

    assert figures(compiled) == figures(python)
    assert compiled.bytes_moved.get(f"{tiers[0][0]}->hbm", 0) > 0 and compiled.bytes_moved[f"hbm->{tiers[0][0]}"] > 0


# -- finding 3: whether a run is offline is recorded ----------------------------------------------------------------
def test_results_record_whether_each_runs_policy_is_offline(trace, tmp_path):
    doc = _replay(trace, "hbm=6,dram=20", tmp_path / "r.json", "--policy", "lru,belady")
    assert doc["schema_version"] == 10
    assert {r["policy"]: r["offline"] for r in doc["runs"]} == {"lru": False, "belady": True}


def _renamed_belady(path, version: int | None = None):
    """The results file with its belady run renamed to an out-of-tree policy no one can import (as
    where the report is built without the policy's module), optionally written as an older version."""
    data = json.loads(path.read_text())
    for run in data["runs"]:
        if run["policy"] == "belady":
            run["policy"] = "gone_module.oracle:Min"
        if version is not None:
            del run["offline"]
    if version is not None:
        data["schema_version"] = version
    out = path.with_name(f"renamed{version}.json")
    out.write_text(json.dumps(data))
    return out


def test_report_leaves_a_recorded_offline_policy_out_where_its_module_does_not_import(trace, tmp_path):
    path = tmp_path / "r.json"
    _replay(trace, "hbm=6,dram=20", path, "--policy", "lru,arc,belady")
    document = read_results(_renamed_belady(path))
    oracle = next(r for r in document.runs if r.policy == "gone_module.oracle:Min")
    assert oracle.offline is True and is_offline(oracle)
    assert oracle.misses < min(r.misses for r in document.runs if r is not oracle)  # it would win if it competed
    (best,) = best_per_capacity(list(document.runs))
    assert best.best.policy in ("lru", "arc")


def test_older_results_read_offline_as_not_recorded_and_fall_back_to_the_names(trace, tmp_path):
    path = tmp_path / "r.json"
    _replay(trace, "hbm=6,dram=20", path, "--policy", "lru,belady")
    old = read_results(_renamed_belady(path, version=7))
    assert [r.offline for r in old.runs] == [None, None]
    assert [is_offline(r) for r in old.runs] == [False, False]  # an unknown name: as before, no flag to go by
    data = json.loads(path.read_text())
    for run in data["runs"]:
        del run["offline"]
    data["schema_version"] = 7
    upgraded = ResultsDocument.from_json(data, "v7.json")
    assert [(r.offline, is_offline(r)) for r in upgraded.runs] == [(None, False), (None, True)]
    again = ResultsDocument.from_json(json.loads(json.dumps(upgraded.to_json())), "v8.json")
    assert again == upgraded


@pytest.mark.parametrize("value, needle", [(1, "got 1"), ("yes", "got 'yes'")])
def test_a_mistyped_offline_flag_is_refused_naming_the_run(trace, tmp_path, value, needle):
    path = tmp_path / "r.json"
    data = _replay(trace, "hbm=6,dram=20", path, "--policy", "lru")
    data["runs"][0]["offline"] = value
    with pytest.raises(UserError, match=rf"bad.json: run 1: field 'offline' must be null or a boolean .*{needle}"):
        ResultsDocument.from_json(data, "bad.json")
    del data["runs"][0]["offline"]
    with pytest.raises(UserError, match="bad.json: run 1: missing field"):
        ResultsDocument.from_json(data, "bad.json")
