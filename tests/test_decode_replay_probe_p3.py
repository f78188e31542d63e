"""Probe P3, findings 2 and 4: decode replay of step traces.

* One protocol for every ``--prefetch``: a prefetch policy that plans nothing (a synthetic
  trace has no ``candidates``/``ahead``) replays to exactly the counts of ``--prefetch
  none``, and a record's own misses never push out a block the same record reads (its reads
  are one step of attention). Each decode run records what its prefetches did (prefetched,
  used, wasted), the results reader reads files without those counts, and the report shows
  them.
* Belady on a step trace: a later write of an id is not a use of the cached copy (the write
  stores a new block); the next use is the next read before any write of the id, in the
  replay and in the oracleGeneral export.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tiercache.config import CacheConfig, TierConfig
from tiercache.errors import UserError
from tiercache.policies import PREFETCH
from tiercache.policies.base import NO_NEXT_USE
from tiercache.report.model import from_documents
from tiercache.report.tables import results_csv, runs_table
from tiercache.results import ResultsDocument, RunRecord, Semantics
from tiercache.sim.loader import load_trace
from tiercache.sim.oracle import export_trace, read_oracle_general
from tiercache.sim.prep import step_next_use
from tiercache.sim.replay import ReplayData, RunSpec, replay
from tiercache.sim.steptrace import StepRecord, write_steps
from tiercache.sim.sweep import SweepSpec, sweep
from tiercache.sim.synth import SparseSpec, sparse_trace

_HIERARCHY = (TierConfig("hbm", 10), TierConfig("dram", 20), TierConfig("nvme", 100))


def _run(path, policy: str = "lru", prefetch: str = "none", tiers=_HIERARCHY) -> RunRecord:
    data = ReplayData.prepare(load_trace(path), None, None)
    return replay(RunSpec(policy, Semantics.DECODE, tuple(tiers), prefetch=prefetch), data)


def _steps(tmp_path, records, name="t.jsonl"):
    path = tmp_path / name
    write_steps(path, records, block_tokens=16)
    return path


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    """The probe's synthetic sparse trace: no decode fields, so no prefetch policy plans anything."""
    path = tmp_path_factory.mktemp("p3") / "sp.jsonl"
    spec = SparseSpec(steps=64, prompt_blocks=32, k=4, sink=1, window=2, block_tokens=8, layers=2, seed=1)
    write_steps(path, sparse_trace(spec), block_tokens=8)
    return path


def _counters(run: RunRecord) -> list[dict]:
    return [t.to_json() for t in run.tiers]


@pytest.mark.parametrize("prefetch", sorted(set(PREFETCH) - {"none"}))
@pytest.mark.parametrize("policy", ["lru", "fifo", "arc"])
def test_a_prefetch_that_plans_nothing_replays_to_the_none_counts(sparse, policy, prefetch):
    none, other = _run(sparse, policy), _run(sparse, policy, prefetch)
    assert (none.hits, none.misses, _counters(none)) == (other.hits, other.misses, _counters(other))
    assert none.tiers[0].hits > 0  # the probe's `none` run: hbm=0, dram=851 (its own misses evicted its reads)
    assert other.prefetched == other.prefetch_used == other.prefetch_wasted == 0


def test_a_records_misses_never_evict_a_block_the_same_record_reads(tmp_path):
    # One tier of 3: blocks 1, 2, 3 stored (1 least recent); record 1 reads 4 (a miss) then 1.
    path = _steps(tmp_path, [StepRecord(0, 0, (), (1, 2, 3)), StepRecord(1, 0, (4, 1), ())])
    run = _run(path, "lru", tiers=(TierConfig("hbm", 3),))
    assert (run.hits, run.misses) == (1, 1)  # 1 is referenced while its record reads: 4's miss evicts 2


def _prefetching_trace(tmp_path):
    """hbm=2: blocks 3, 4 in HBM and 1, 2 in DRAM; record 1 prefetches 1 (read next: used),
    record 2 prefetches 2, record 3's two reads push 1 and 2 down, record 4 reads 2 below (wasted)."""
    return _steps(tmp_path, [
        StepRecord(0, 0, (), (1, 2, 3, 4)),
        StepRecord(1, 0, (3,), (), candidates=(1,)),
        StepRecord(2, 0, (1,), (), candidates=(2,)),
        StepRecord(3, 0, (4, 3), ()),
        StepRecord(4, 0, (2,), ()),
    ], "pf.jsonl")


def test_a_run_records_blocks_prefetched_used_and_wasted(tmp_path):
    tiers = (TierConfig("hbm", 2), TierConfig("dram", 10))
    run = _run(_prefetching_trace(tmp_path), "lru", "topk_speculative", tiers)
    assert (run.prefetched, run.prefetch_used, run.prefetch_wasted) == (2, 1, 1)
    moved_up = sum(t.promotions - t.hits_promoted for t in run.tiers)  # promotions no read asked for
    assert moved_up == run.prefetched
    plain = _run(_prefetching_trace(tmp_path), "lru", "none", tiers)
    assert (plain.prefetched, plain.prefetch_used, plain.prefetch_wasted) == (0, 0, 0)


def test_prefetch_counts_reach_the_results_file_the_reader_and_the_report(tmp_path):
    trace = load_trace(_prefetching_trace(tmp_path))
    spec = SweepSpec(policies=("lru",), semantics=(Semantics.OBJECT,),
                     cache=CacheConfig((TierConfig("hbm", 2), TierConfig("dram", 10))), prefetch="topk_speculative")
    document = sweep(trace, spec)
    data = document.to_json()
    assert data["schema_version"] == 10
    assert (data["runs"][0]["prefetched"], data["runs"][0]["prefetch_used"], data["runs"][0]["prefetch_wasted"]) == (2, 1, 1)
    back = ResultsDocument.from_json(json.loads(json.dumps(data)), "r.json")
    assert back.runs[0].prefetched == 2
    report = from_documents([back], ["r.json"])
    table = runs_table(report)
    column = table.header.index("prefetched (used / wasted)")
    assert table.rows[0][column] == "2 (1 / 1)"
    csv_header, csv_row = results_csv(report).splitlines()[:2]
    assert dict(zip(csv_header.split(","), csv_row.split(",")))["prefetch_wasted"] == "1"
    from tiercache.cli.replay import format_table

    assert format_table(back).splitlines()[-1] == (
        "lru (prefetch topk_speculative): prefetched 2 blocks, 1 read where it put them, 1 pushed down or out unread")
    # A version 8 file written before the counts, and a version 7 one, read them as not recorded.
    for version in (8, 7):
        old = json.loads(json.dumps(data))
        old["schema_version"] = version
        for key in ("prefetched", "prefetch_used", "prefetch_wasted") + (("offline",) if version == 7 else ()):
            del old["runs"][0][key]
        run = ResultsDocument.from_json(old, "old.json").runs[0]
        assert run.prefetched is None and run.prefetch_used is None and run.prefetch_wasted is None
        table = runs_table(from_documents([ResultsDocument.from_json(old, "old.json")], ["old.json"]))
        assert table.rows[0][table.header.index("prefetched (used / wasted)")] == "not recorded"
    # Counts that cannot be (more used and wasted than prefetched; some missing) are refused by name.
    bad = json.loads(json.dumps(data))
    bad["runs"][0]["prefetch_wasted"] = 5
    with pytest.raises(UserError, match=r"bad.json: run 1: .*prefetch_wasted 5 > prefetched 2"):
        ResultsDocument.from_json(bad, "bad.json")
    bad["runs"][0]["prefetch_wasted"] = None
    with pytest.raises(UserError, match="all or none"):
        ResultsDocument.from_json(bad, "bad.json")


def test_step_next_use_is_the_next_read_before_any_write():
    # write 1, 2 | read 3 | write 1 | read 2, 1 (ids 1, 2, 3, 1, 2, 1)
    is_write = np.array([True, True, False, True, False, False])
    flat = np.array([3, 4, NO_NEXT_USE, 5, NO_NEXT_USE, NO_NEXT_USE])
    assert step_next_use(flat, is_write).tolist() == [NO_NEXT_USE, 4, NO_NEXT_USE, 5, NO_NEXT_USE, NO_NEXT_USE]


def _belady_write(tmp_path):
    """The probe's trace: write [1, 2]; read [3]; write [1]; read [2]."""
    return _steps(tmp_path, [StepRecord(0, 0, (), (1, 2)), StepRecord(1, 0, (3,), ()), StepRecord(2, 0, (), (1,)),
                             StepRecord(3, 0, (2,), ())], "bw.jsonl")


def test_belady_does_not_keep_a_block_for_its_rewrite(tmp_path):
    run = _run(_belady_write(tmp_path), "belady", tiers=(TierConfig("hbm", 2),))
    assert (run.hits, run.misses) == (1, 1)  # 3's miss evicts 1 (re-stored free by the write), keeps 2
    lru = _run(_belady_write(tmp_path), "lru", tiers=(TierConfig("hbm", 2),))
    assert run.misses <= lru.misses


def test_belady_in_a_hierarchy_never_misses_more_than_lru_on_a_sparse_trace(sparse):
    tiers = (TierConfig("hbm", 4), TierConfig("dram", 6))
    assert _run(sparse, "belady", tiers=tiers).misses <= _run(sparse, "lru", tiers=tiers).misses


def test_the_oracle_general_export_of_a_step_trace_writes_the_replays_next_use(tmp_path):
    trace = load_trace(_belady_write(tmp_path))
    export_trace(trace, tmp_path / "bw.oracleGeneral")
    records = read_oracle_general(tmp_path / "bw.oracleGeneral")
    assert records["obj_id"].tolist() == [1, 2, 3, 1, 2]
    # 1-based next read before any write of the id, -1 for none (1's copy dies at its rewrite)
    assert records["next_access_vtime"].tolist() == [-1, 5, -1, -1, -1]
    data = ReplayData.prepare(trace, None, None)
    expected = [-1 if n == NO_NEXT_USE else n + 1 for n in data.next_use.tolist()]
    assert records["next_access_vtime"].tolist() == expected
