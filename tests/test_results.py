"""The results.json schema (tiercache.results): round trip, strict reading, the version-1 upgrade."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from tiercache.core.stats import HierarchyStats, TierCounters
from tiercache.errors import UserError
from tiercache.results import (
    SCHEMA_VERSION,
    InstanceRecord,
    LayoutInfo,
    Mode,
    ResultsDocument,
    Route,
    RunRecord,
    Semantics,
    TierRecord,
    TraceInfo,
    TraceKind,
    read_results,
    write_results,
)


def tier(name: str, hits: int, base: int) -> TierRecord:
    """A tier whose every counter has its own value, so a swapped field shows."""
    return TierRecord(name, base + 1, hits, base + 2, base + 3, base + 4, base + 5, base + 6, base + 7,
                      base + 8, base + 9, base + 10, hits - 7, 7, base + 11, base + 12, base + 13.5, base + 14.5,
                      "int4" if name == "dram" else "fp8", base + 15)


def full_document() -> ResultsDocument:
    """Every field set, none to its default."""
    run = RunRecord(
        policy="s3fifo", admission="second_hit", semantics=Semantics.PREFIX, mode=Mode.WRITE_THROUGH,
        capacity_blocks=302, accesses=1000, hits=600, misses=400, recomputed=17, miss_ratio=0.4, hit_ratio=0.6,
        tiers=(tier("hbm", 500, 100), tier("dram", 100, 200)), wall_seconds=1.25,
        bytes_moved={"hbm->dram": 1 << 30, "dram->hbm": 12345}, modeled_seconds={"hbm->dram": 0.5, "recompute": 2.0, "total": 2.5},
        prefill_tokens=5_000_000, prefill_tokens_saved=300_000, ttft_saved_s=-0.75, placement="reuse",
    )
    decode = dataclasses.replace(run, semantics=Semantics.DECODE, mode=Mode.EXCLUSIVE, prefill_tokens=None,
                                 prefill_tokens_saved=None, ttft_saved_s=None)
    instances = (
        InstanceRecord(0, 3, 400, 250, 150, {"hbm": 200, "dram": 30, "remote": 20}, {"remote->hbm": 1 << 20},
                       {"remote->hbm": 0.25}, 90_000, 1.5),
        InstanceRecord(1, 4, 600, 350, 250, {"hbm": 300, "dram": 20, "remote": 30}, {"remote->hbm": 3 << 20},
                       {"remote->hbm": 0.5}, 210_000, -2.25),
    )
    fleet = dataclasses.replace(run, mode=Mode.EXCLUSIVE, instances=instances, route=Route.PREFIX_AFFINITY, shared_writes=42)
    return ResultsDocument(
        tiercache_version="9.9.9", command="tiercache replay t.jsonl --policy s3fifo",
        trace=TraceInfo("/data/t.jsonl", "t.jsonl", "ab" * 16, TraceKind.STEPS, 12, 1000, 321),
        layout=LayoutInfo("custom", 2, 4, 8, "float16", 16, 2048), hardware="h200-pcie5-nvme4", runs=(run, decode, fleet),
    )


def test_round_trip_keeps_every_field(tmp_path):
    document = full_document()
    path = tmp_path / "results.json"
    write_results(path, document, "--out")
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION == document.schema_version
    assert read_results(path) == document
    # Every dataclass field is written under its own name (nothing dropped on the way out).
    for record, written in ((document.runs[0], data["runs"][0]), (document.runs[0].tiers[0], data["runs"][0]["tiers"][0]),
                            (document.trace, data["trace"]), (document.layout, data["layout"]),
                            (document.runs[2].instances[0], data["runs"][2]["instances"][0])):
        assert set(written) == {f.name for f in dataclasses.fields(record)}
    assert set(data) == {f.name for f in dataclasses.fields(document)}


def test_every_counter_the_manager_keeps_is_in_the_schema():
    stats = HierarchyStats.for_tiers([("hbm", 4)])
    split = {"hits_in_place", "hits_promoted", "in_place_bytes", "promoted_bytes", "in_place_seconds", "promoted_seconds"}
    codec = {"codec", "block_bytes"}  # how the tier stores blocks: its config, not a counter
    assert {f.name for f in dataclasses.fields(TierCounters)} | split | codec == {f.name for f in dataclasses.fields(TierRecord)}
    run_fields = {f.name for f in dataclasses.fields(RunRecord)}
    assert {"misses", "recomputed"} <= run_fields and {"misses", "recomputed"} <= set(vars(stats))


_SPLIT = ("hits_in_place", "hits_promoted", "in_place_bytes", "promoted_bytes", "in_place_seconds", "promoted_seconds")


def v5_document() -> dict:
    """A file as version 5 wrote it: no placement (every run placed blocks in the top tier)."""
    data = full_document().to_json()
    data["schema_version"] = 5
    for run in data["runs"]:
        del run["placement"]
    return data


def _placed_on_top(runs) -> list[RunRecord]:
    return [dataclasses.replace(r, placement="top") for r in runs]


def test_version_5_upgrade_places_every_run_on_top():
    upgraded = ResultsDocument.from_json(v5_document(), "old.json")
    assert [r.placement for r in upgraded.runs] == ["top"] * 3
    assert list(upgraded.runs) == _placed_on_top(full_document().runs)
    assert ResultsDocument.from_json(json.loads(json.dumps(upgraded.to_json())), "new.json") == upgraded


def test_placement_names_and_keys_the_run():
    document = full_document()
    placed, top = document.runs[0], dataclasses.replace(document.runs[0], placement="top")
    assert placed.label == "s3fifo+second_hit@reuse" and top.label == "s3fifo+second_hit"
    assert placed.key != top.key


def v4_document() -> dict:
    """A file as version 4 wrote it: one engine per run (no instances, route, shared writes)."""
    data = v5_document()
    data["schema_version"] = 4
    del data["runs"][2]  # version 4 had no fleet runs
    for run in data["runs"]:
        del run["instances"], run["route"], run["shared_writes"]
    return data


def test_version_4_upgrade_reads_every_run_as_one_engine():
    upgraded = ResultsDocument.from_json(v4_document(), "old.json")
    assert all(r.instances is None and r.route is None and r.shared_writes is None and not r.is_fleet for r in upgraded.runs)
    assert list(upgraded.runs) == _placed_on_top(full_document().runs[:2])
    assert ResultsDocument.from_json(json.loads(json.dumps(upgraded.to_json())), "new.json") == upgraded


def test_version_4_still_requires_what_it_wrote():
    data = v4_document()
    del data["runs"][0]["ttft_saved_s"]
    with pytest.raises(UserError, match=r"old.json: run 1: missing field\(s\) ttft_saved_s"):
        ResultsDocument.from_json(data, "old.json")


def test_a_fleet_run_keeps_its_instances_and_is_not_the_same_run_as_one_engine():
    document = full_document()
    fleet = document.runs[2]
    assert fleet.is_fleet and [i.shared_hits for i in fleet.instances] == [20, 30]
    assert fleet.key != document.runs[0].key  # same policy, semantics, mode and tiers, but over two instances
    data = document.to_json()["runs"][2]
    assert data["route"] == "prefix_affinity" and data["shared_writes"] == 42
    assert data["instances"][1]["tier_hits"] == {"hbm": 300, "dram": 20, "remote": 30}


def v3_document() -> dict:
    """A file as version 3 wrote it: no codec per tier."""
    data = v4_document()
    data["schema_version"] = 3
    for run in data["runs"]:
        for tier_entry in run["tiers"]:
            del tier_entry["codec"], tier_entry["block_bytes"]
    return data


def test_version_3_upgrade_reads_every_tier_as_unquantised():
    upgraded = ResultsDocument.from_json(v3_document(), "old.json")
    assert all(t.codec == "none" and t.block_bytes is None for r in upgraded.runs for t in r.tiers)
    assert ResultsDocument.from_json(json.loads(json.dumps(upgraded.to_json())), "new.json") == upgraded


def v2_document() -> dict:
    """A file as version 2 wrote it: no split of the hits into read in place and promoted."""
    data = v3_document()
    data["schema_version"] = 2
    for run in data["runs"]:
        for tier_entry in run["tiers"]:
            for key in _SPLIT:
                del tier_entry[key]
    return data


def test_version_2_upgrade_marks_the_hit_split_not_recorded():
    upgraded = ResultsDocument.from_json(v2_document(), "old.json")
    tiers = upgraded.runs[0].tiers
    assert all(getattr(t, key) is None for t in tiers for key in _SPLIT)
    assert [t.hits for t in tiers] == [500, 100] and tiers[1].promote_skipped == 209
    assert ResultsDocument.from_json(json.loads(json.dumps(upgraded.to_json())), "new.json") == upgraded


def test_version_2_still_requires_what_it_wrote():
    data = v2_document()
    del data["runs"][0]["tiers"][1]["promote_skipped"]
    with pytest.raises(UserError, match=r"old.json: run 1: tier 2: missing field\(s\) promote_skipped"):
        ResultsDocument.from_json(data, "old.json")


def v1_document() -> dict:
    """A file as tiercache wrote it before versioning: no schema_version, no v2 counters."""
    data = v2_document()
    del data["schema_version"]
    data["trace"]["kind"] = "step"
    for run in data["runs"]:
        del run["recomputed"]
        for tier_entry in run["tiers"]:
            for key in ("failed_transfers", "promote_skipped", "lost"):
                del tier_entry[key]
        for key in ("prefill_tokens", "prefill_tokens_saved", "ttft_saved_s"):
            if run[key] is None:
                del run[key]  # version 1 wrote them only in prefix semantics
    return data


def test_version_1_upgrade_fills_only_what_it_did_not_record():
    upgraded = ResultsDocument.from_json(v1_document(), "old.json")
    assert upgraded.trace.kind is TraceKind.STEPS
    first = upgraded.runs[0]
    assert first.recomputed is None and first.prefill_tokens == 5_000_000
    assert all(t.lost is None and t.failed_transfers is None and t.promote_skipped is None for t in first.tiers)
    assert [t.hits for t in first.tiers] == [500, 100] and first.tiers[0].refused == 107
    assert upgraded.runs[1].prefill_tokens is None
    # An upgraded document writes as the current version and reads back unchanged (None stays "not recorded").
    assert ResultsDocument.from_json(json.loads(json.dumps(upgraded.to_json())), "new.json") == upgraded


def test_version_1_still_requires_what_it_wrote():
    data = v1_document()
    del data["runs"][1]["tiers"][0]["copies"]
    with pytest.raises(UserError, match=r"old.json: run 2: tier 1: missing field\(s\) copies"):
        ResultsDocument.from_json(data, "old.json")


def _mutated(change) -> dict:
    data = copy.deepcopy(full_document().to_json())
    change(data)
    return data


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda d: d.update(schema_version=11), "r.json: results schema_version 11 is not one"),
        (lambda d: d["runs"][0].pop("instances"), "r.json: run 1: missing field(s) instances"),
        (lambda d: d["runs"][2].update(instances=[]), "r.json: run 3: field 'instances' must be null or a non-empty list"),
        (lambda d: d["runs"][2]["instances"][1].pop("tier_hits"), "r.json: run 3: instance 2: missing field(s) tier_hits"),
        (lambda d: d["runs"][2]["instances"][0].update(hits=251), "r.json: run 3: instance 1: inconsistent counts"),
        (lambda d: d["runs"][2]["instances"][0]["tier_hits"].update(hbm=-1), "r.json: run 3: instance 1: field 'tier_hits'"),
        (lambda d: d["runs"][2].update(route=None), "r.json: run 3: inconsistent counts: a fleet run has at least one"),
        (lambda d: d["runs"][0].update(route="round_robin"), "r.json: run 1: inconsistent counts: route and shared_writes"),
        (lambda d: d["runs"][2].update(route="random"), "r.json: run 3: field 'route' must be null or round_robin/prefix_affinity/kv_aware"),
        (lambda d: d["runs"][2]["instances"][1].update(misses=0, accesses=350), "run 3: inconsistent counts: the instances'"),
        (lambda d: d["runs"][0]["tiers"][0].update(codec="int3"), "r.json: run 1: tier 1: field 'codec' must be one of none"),
        (lambda d: d["runs"][0]["tiers"][1].pop("codec"), "r.json: run 1: tier 2: missing field(s) codec"),
        (lambda d: d["runs"][0]["tiers"][0].pop("hits_in_place"), "r.json: run 1: tier 1: missing field(s) hits_in_place"),
        (lambda d: d["runs"][0]["tiers"][0].update(hits_promoted=8), "r.json: run 1: tier 1: inconsistent counts"),
        (lambda d: d.update(schema_version="2"), "schema_version '2'"),
        (lambda d: d["runs"][1].pop("recomputed"), "r.json: run 2: missing field(s) recomputed"),
        (lambda d: d["runs"][0]["tiers"][1].pop("lost"), "r.json: run 1: tier 2: missing field(s) lost"),
        (lambda d: d["runs"][1].update(hits="600"), "r.json: run 2: field 'hits' must be a non-negative integer, got '600'"),
        (lambda d: d["runs"][0].update(semantics="sideways"), "r.json: run 1: field 'semantics' must be object/prefix/decode"),
        (lambda d: d["runs"][0].update(mode=None), "r.json: run 1: field 'mode'"),
        (lambda d: d["runs"][0].update(misses=1), "r.json: run 1: inconsistent counts"),
        (lambda d: d["runs"][0]["bytes_moved"].update(x=-1), "r.json: run 1: field 'bytes_moved'"),
        (lambda d: d["trace"].update(kind="step"), "r.json: trace: field 'kind' must be requests/steps"),
        (lambda d: d["trace"].pop("fingerprint"), "r.json: trace: missing field 'fingerprint'"),
        (lambda d: d["layout"].pop("dtype"), "r.json: layout: missing field(s) dtype"),
        (lambda d: d.update(layout="llama"), "r.json: malformed 'layout'"),
        (lambda d: d.update(hardware=7), "field 'hardware' must be null or a preset name"),
        (lambda d: d.pop("command"), "r.json: missing field 'command'"),
        (lambda d: d.update(runs=[]), "r.json: the results file has no runs"),
        (lambda d: d.update(runs=[3]), "r.json: malformed 'run 1'"),
        # probe Q80-4/6: figures only a damaged or hand-edited file holds
        (lambda d: d["runs"][2]["instances"][0].update(ttft_saved_s=None),
         "r.json: run 3: inconsistent figures: instance 0: ttft_saved_s None beside the run's -0.75"),
        (lambda d: d["runs"][0]["modeled_seconds"].update(recompute=-2.0, total=-1.5),
         "r.json: run 1: inconsistent figures: modeled_seconds 'recompute' is -2.0; modeled seconds are finite"),
        (lambda d: d["runs"][0]["modeled_seconds"].update(total=9.0),
         "r.json: run 1: inconsistent figures: modeled_seconds total 9.0 is not the sum of its parts (2.5)"),
        (lambda d: d["runs"][2]["instances"][1]["modeled_seconds"].update({"remote->hbm": -0.5}),
         "r.json: run 3: inconsistent figures: instance 1: modeled_seconds 'remote->hbm' is -0.5"),
        (lambda d: d["runs"][0].update(prefill_tokens=0),
         "r.json: run 1: inconsistent figures: prefill_tokens_saved 300000 > prefill_tokens 0"),
    ],
)
def test_strict_reading_names_file_run_and_field(change, needle):
    with pytest.raises(UserError) as info:
        ResultsDocument.from_json(_mutated(change), "r.json")
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_records_check_their_counts():
    with pytest.raises(ValueError, match="accesses"):
        dataclasses.replace(full_document().runs[0], misses=1)


@pytest.mark.parametrize("figure", [float("inf"), float("nan")])
def test_a_figure_the_reader_refuses_is_not_written(tmp_path, figure):
    """A non-finite figure made a results file that ``tiercache report`` then refused."""
    document = full_document()
    bad = dataclasses.replace(document.runs[0], modeled_seconds={"hbm->dram": figure, "total": figure})
    path = tmp_path / "results.json"
    path.write_text("earlier")
    with pytest.raises(UserError, match=r"^--out .*results.json: a figure of this run is not a finite number"):
        write_results(path, dataclasses.replace(document, runs=(bad,)), "--out")
    assert path.read_text() == "earlier"
