"""Probe R5: decode replay through the step protocol (after probe P3's change).

* Belady on a step trace that rewrites an id still cached: the write stores nothing (keys name
  content), so it refreshes the policy's next use of the id to the write's own; Belady is
  then never worse than LRU in one tier, plays exactly what libCacheSim plays on the
  oracleGeneral export, and still equals plain OPT on reads-only traces.
* A prefetched block that leaves its tier and is written anew before any read is wasted, not
  used.
* The results reader refuses a ``--prefetch none`` run with prefetch counts.
* A report of a step trace's results file written before a step block was charged one layer's
  bytes says so, alone and next to a newer file.
"""

from __future__ import annotations

import json
import random

import pytest

from tiercache.cli import main as cli_main
from tiercache.config import TierConfig
from tiercache.errors import UserError
from tiercache.report.model import load_results
from tiercache.report.tables import trace_table
from tiercache.results import Semantics, read_results
from tiercache.sim.loader import load_trace
from tiercache.sim.oracle import export_trace, read_oracle_general
from tiercache.sim.replay import ReplayData, RunSpec, replay
from tiercache.sim.steptrace import StepRecord, write_steps


def _steps(tmp_path, records, name="t.jsonl"):
    path = tmp_path / name
    write_steps(path, [StepRecord(i, 0, tuple(r), tuple(w)) for i, (r, w) in enumerate(records)], block_tokens=16)
    return path


def _hits(path, capacity: int, policies=("lru", "fifo", "belady")) -> dict[str, int]:
    data = ReplayData.prepare(load_trace(path), None, None)
    tiers = (TierConfig("hbm", capacity),)
    return {p: replay(RunSpec(p, Semantics.DECODE, tiers), data).hits for p in policies}


# The probe's trace: 1 is read, rewritten while cached, then read again after 3 is written.
_REWRITE = [([], [1, 2]), ([2], []), ([1], []), ([], [1]), ([], [3]), ([1], []), ([3], []), ([2], [])]


def test_belady_keeps_a_block_whose_cached_id_is_rewritten(tmp_path):
    hits = _hits(_steps(tmp_path, _REWRITE), 2)
    assert hits == {"lru": 4, "fifo": 3, "belady": 4}


def test_belady_keeps_a_block_rewritten_twice(tmp_path):
    records = [([], [1, 2]), ([2], []), ([1], []), ([], [1]), ([], [1]), ([], [3]), ([1], []), ([3], []), ([2], [])]
    hits = _hits(_steps(tmp_path, records), 2)
    assert hits["belady"] >= hits["lru"] == 4


def _random_rewrites(rng: random.Random) -> tuple[list, int]:
    n = rng.randint(4, 10)
    most = rng.choice([1, 1, 2, 3])
    records = [([], list(range(n)))]
    for _ in range(rng.randint(20, 120)):
        u = rng.random()
        if u < 0.3:
            records.append(([], rng.sample(range(n), rng.randint(1, 2))))
        elif u < 0.35:
            records.append((rng.sample(range(n), rng.randint(1, most)), rng.sample(range(n), 1)))
        else:
            records.append((rng.sample(range(n), rng.randint(1, most)), []))
    return records, rng.randint(most, n - 1)  # a capacity at least one record's reads


def test_belady_never_worse_than_lru_or_fifo_with_rewrites(tmp_path):
    rng = random.Random(1)
    worse = []
    for trial in range(150):
        records, capacity = _random_rewrites(rng)
        hits = _hits(_steps(tmp_path, records, f"r{trial}.jsonl"), capacity)
        if hits["belady"] < max(hits["lru"], hits["fifo"]):
            worse.append((trial, capacity, hits))
    assert worse == []


def _opt_hits(reads: list[int], capacity: int) -> int:
    """Plain MIN over a read stream: every miss stored, the farthest next use evicted."""
    following, last = [0] * len(reads), {}
    for i in range(len(reads) - 1, -1, -1):
        following[i] = last.get(reads[i], float("inf"))
        last[reads[i]] = i
    cache, hits = {}, 0
    for i, block in enumerate(reads):
        if block in cache:
            hits += 1
        elif len(cache) >= capacity:
            del cache[max(cache, key=cache.get)]
        cache[block] = following[i]
    return hits


def test_belady_still_equals_opt_on_reads(tmp_path):
    rng = random.Random(7)
    for trial in range(40):
        n, capacity = rng.randint(5, 20), rng.randint(1, 8)
        reads = [rng.randrange(n) for _ in range(rng.randint(20, 150))]
        hits = _hits(_steps(tmp_path, [([b], []) for b in reads], f"o{trial}.jsonl"), capacity, ("lru", "belady"))
        assert hits["belady"] == _opt_hits(reads, capacity) >= hits["lru"]


def _libcachesim_belady(records, capacity: int) -> int:
    """What libCacheSim's Belady plays on an oracleGeneral export: every record a request
    (a write record of a cached id a hit that takes the record's next access), the farthest
    next access evicted on a miss; returns the hits of the reads only."""
    cache: dict[int, float] = {}
    hits = 0
    for block, nxt, is_read in records:
        when = float("inf") if nxt == -1 else nxt
        if block in cache:
            hits += is_read
        elif len(cache) >= capacity:
            del cache[max(cache, key=cache.get)]
        cache[block] = when
    return hits


def test_belady_replay_plays_what_libcachesim_plays_on_the_export(tmp_path):
    rng = random.Random(3)
    for trial in range(60):
        n = rng.randint(3, 8)
        records = [([], list(range(n)))]
        for _ in range(rng.randint(10, 80)):  # one id per record: no references in play
            records.append(([rng.randrange(n)], []) if rng.random() < 0.7 else ([], [rng.randrange(n)]))
        path = _steps(tmp_path, records, f"e{trial}.jsonl")
        capacity = rng.randint(1, n - 1)
        out = tmp_path / f"e{trial}.oracle"
        export_trace(load_trace(path), out)
        exported = read_oracle_general(out)
        is_read = [flag for reads, writes in records for flag in [True] * len(reads) + [False] * len(writes)]
        stream = list(zip(exported["obj_id"].tolist(), exported["next_access_vtime"].tolist(), is_read))
        assert _hits(path, capacity, ("belady",))["belady"] == _libcachesim_belady(stream, capacity), trial


def test_export_of_a_rewrite(tmp_path):
    """The read before a write of its id is that copy's last use (-1); the write's record
    carries the next read after it (1-based), which the replay sets for a cached id."""
    path = _steps(tmp_path, [([], [1]), ([1], []), ([], [1]), ([1], [])])
    out = tmp_path / "rw.oracle"
    export_trace(load_trace(path), out)
    assert read_oracle_general(out)["next_access_vtime"].tolist() == [2, -1, 4, -1]


_HBM2_DRAM3 = (TierConfig("hbm", 2), TierConfig("dram", 3))


def _prefetch_counts(tmp_path, records: list[StepRecord]) -> dict[str, int]:
    path = tmp_path / "pf.jsonl"
    write_steps(path, records, block_tokens=16)
    run = replay(RunSpec("lru", Semantics.DECODE, _HBM2_DRAM3, prefetch="layer_ahead"),
                 ReplayData.prepare(load_trace(path), None, None))
    return {"prefetched": run.prefetched, "used": run.prefetch_used, "wasted": run.prefetch_wasted, "hits": run.hits}


def test_prefetched_block_evicted_then_written_anew_is_wasted(tmp_path):
    counts = _prefetch_counts(tmp_path, [
        StepRecord(0, 0, (), (1, 2, 3, 4, 5)),
        StepRecord(1, 0, (5,), (), ahead=(1,)),  # 1 brought up to HBM
        StepRecord(2, 0, (), (10, 11, 12, 13, 14)),  # every block before pushed out, 1 too
        StepRecord(3, 0, (), (1,)),  # a new block under id 1
        StepRecord(4, 0, (1,), ()),  # reads the new block, not the prefetched one
    ])
    assert counts == {"prefetched": 1, "used": 0, "wasted": 1, "hits": 2}


def test_prefetched_block_rewritten_in_place_is_used(tmp_path):
    counts = _prefetch_counts(tmp_path, [
        StepRecord(0, 0, (), (1, 2, 3, 4, 5)),
        StepRecord(1, 0, (5,), (), ahead=(1,)),
        StepRecord(2, 0, (), (1,)),  # still in HBM: the write stores nothing
        StepRecord(3, 0, (1,), ()),
    ])
    assert counts == {"prefetched": 1, "used": 1, "wasted": 0, "hits": 2}


def _results(tmp_path, trace, name: str, *args: str):
    out = tmp_path / name
    assert cli_main(["replay", str(trace), "--no-progress", "--out", str(out), *args]) == 0
    return out


def test_reader_refuses_prefetch_none_with_counts(tmp_path, capsys):
    trace = _steps(tmp_path, _REWRITE)
    out = _results(tmp_path, trace, "none.json", "--policy", "lru", "--capacity", "2")
    document = json.loads(out.read_text())
    document["runs"][0].update(prefetched=5, prefetch_used=0, prefetch_wasted=0)
    out.write_text(json.dumps(document))
    with pytest.raises(UserError, match=r"prefetch 'none' .* got prefetched 5"):
        read_results(out)


def _stale_copy(tmp_path, new) -> object:
    """``new`` as a file from before step blocks were charged one layer's bytes: the whole
    model's block bytes (llama-3-8b: 32 layers)."""
    document = json.loads(new.read_text())
    document["layout"]["block_bytes"] *= document["layout"]["layers"]
    for run in document["runs"]:
        for tier in run["tiers"]:
            tier["block_bytes"] = document["layout"]["block_bytes"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(document))
    return old


@pytest.fixture
def stale_pair(tmp_path):
    records = [([], [0, 1, 2, 3]), ([0, 1], []), ([2, 3], [4]), ([0, 4], [])]
    trace = _steps(tmp_path, records)
    new = _results(tmp_path, trace, "new.json", "--policy", "lru", "--capacity", "3", "--model", "llama-3-8b")
    return _stale_copy(tmp_path, new), new


def test_report_says_which_layout_field_differs_and_which_file_is_stale(stale_pair):
    old, new = stale_pair
    with pytest.raises(UserError) as caught:
        load_results([str(old), str(new)])
    message = str(caught.value)
    assert f"{new} used another layout than {old} (llama-3-8b: block_bytes 65536 (one layer's KV) vs 2097152 " \
           "(every layer's KV))" in message
    assert f"{old} charged each block of this step trace the whole model's KV" in message
    assert "(llama-3-8b) than" not in message


def test_report_of_a_stale_step_file_alone_says_its_bytes_are_too_high(stale_pair):
    old, new = stale_pair
    rows = dict(trace_table(load_results([str(old)])).rows)
    assert rows["one block"] == "16 tokens = 2 MiB of KV (every layer)"
    assert "32x (the layer count) too high" in rows["note"]
    assert "note" not in dict(trace_table(load_results([str(new)])).rows)
