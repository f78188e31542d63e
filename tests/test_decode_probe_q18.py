"""Probe q18 (step-trace replay and export).

* A record's write list is stored in list order: an id cached when the record began that the
  same write's earlier new blocks push out is stored again at its turn (README: an evicted id
  is stored anew with its write), in the online replay (``StepDriver.write``) and the offline
  one (Belady's ``DecodeReplay._write``). Checked on the probe's hand case, against a
  plain-Python LRU with the replay's semantics on random step traces that rewrite ids, and
  against libCacheSim's Belady on the oracleGeneral export when ``import libcachesim`` works.
* A step trace whose step does not fit oracleGeneral's 32-bit clock time is refused by
  ``trace export`` with one line naming the file, the record's line and why (exit 2).
"""

from __future__ import annotations

import random

import pytest

from tiercache.cli import main as cli_main
from tiercache.config import TierConfig
from tiercache.errors import UserError
from tiercache.results import Semantics
from tiercache.sim.loader import load_trace
from tiercache.sim.oracle import export_trace
from tiercache.sim.replay import ReplayData, RunSpec, replay
from tiercache.sim.steptrace import StepRecord, write_steps


def _steps(tmp_path, records, name="t.jsonl"):
    path = tmp_path / name
    write_steps(path, [StepRecord(i, 0, tuple(r), tuple(w)) for i, (r, w) in enumerate(records)], block_tokens=16)
    return path


def _run(path, policy: str, capacity: int):
    data = ReplayData.prepare(load_trace(path), None, None)
    return replay(RunSpec(policy, Semantics.DECODE, (TierConfig("hbm", capacity),)), data)


def _lru_model(records, capacity: int) -> tuple[int, int]:
    """LRU with the replay's step semantics: a record's reads cached when it starts are
    referenced while it reads (never victims of its own misses; a miss finding every slot
    referenced is not stored); a hit moves to the front; then its writes in list order, a
    cached id storing nothing (no access), an absent one stored at the front."""
    order: dict[int, None] = {}  # least recent first
    hits = misses = 0

    def store(block: int, refs: set[int]) -> None:
        if len(order) >= capacity:
            victim = next((b for b in order if b not in refs), None)
            if victim is None:
                return
            del order[victim]
        order[block] = None

    for reads, writes in records:
        refs = {b for b in reads if b in order}
        for block in reads:
            if block in order:
                hits += 1
                del order[block]
                order[block] = None
            else:
                misses += 1
                store(block, refs)
        for block in writes:
            if block not in order:
                store(block, set())
    return hits, misses


def _random_records(rng: random.Random) -> list:
    n = rng.randint(3, 12)
    records = []
    for _ in range(rng.randint(5, 40)):
        reads = rng.sample(range(n), rng.randint(0, min(4, n)))
        records.append((reads, rng.sample(range(n), rng.randint(0, min(4, n)))))
    records.append(([0], []))  # at least one read
    return records


def _libcachesim_read_hits(path, records, capacity: int) -> int | None:
    """libCacheSim's Belady over the oracleGeneral export of ``path``: hits of the read
    records only (the write records are requests to it too); None without libCacheSim."""
    try:
        import libcachesim
    except ImportError:
        return None
    out = path.with_suffix(".oracle")
    export_trace(load_trace(path), out)
    is_read = [flag for reads, writes in records for flag in [True] * len(reads) + [False] * len(writes)]
    reader = libcachesim.TraceReader(str(out), libcachesim.TraceType.ORACLE_GENERAL_TRACE)
    cache = libcachesim.Belady(cache_size=capacity)
    hits = [cache.get(request) for request in reader]
    assert len(hits) == len(is_read)
    return sum(hit for hit, read in zip(hits, is_read) if read)


def test_a_write_stores_its_list_in_order_so_an_id_its_new_blocks_push_out_is_stored_again(tmp_path):
    # The probe's case: step 1 writes 2 (evicting 1) then 1 again, so step 2's read of 1 hits.
    hand = _steps(tmp_path, [([], [1]), ([], [2, 1]), ([1], [])], "hand.jsonl")
    for policy in ("lru", "fifo", "belady"):
        run = _run(hand, policy, 1)
        assert (run.hits, run.misses) == (1, 0), policy
    assert _libcachesim_read_hits(hand, [([], [1]), ([], [2, 1]), ([1], [])], 1) in (None, 1)
    # A prefetched block in place when a write begins, pushed out by that write's earlier new
    # blocks and stored again: the read finds the new copy, so the prefetch is wasted.
    prefetch = tmp_path / "pf.jsonl"
    write_steps(prefetch, [StepRecord(0, 0, (), (1, 2, 3, 4, 5)), StepRecord(1, 0, (5,), (), ahead=(1,)),
                           StepRecord(2, 0, (), (10, 11, 12, 13, 14, 1)), StepRecord(3, 0, (1,), ())], block_tokens=16)
    run = replay(RunSpec("lru", Semantics.DECODE, (TierConfig("hbm", 2), TierConfig("dram", 3)), prefetch="layer_ahead"),
                 ReplayData.prepare(load_trace(prefetch), None, None))
    assert (run.hits, run.prefetched, run.prefetch_used, run.prefetch_wasted) == (2, 1, 0, 1)
    rng = random.Random(18)
    for trial in range(80):
        records, capacity = _random_records(rng), rng.randint(1, 5)
        path = _steps(tmp_path, records, f"r{trial}.jsonl")
        run = _run(path, "lru", capacity)
        assert (run.hits, run.misses) == _lru_model(records, capacity), (trial, capacity, records)
    for trial in range(80):  # one read per record: references, which libCacheSim lacks, play no part
        n, capacity = rng.randint(3, 10), rng.randint(1, 5)
        records = [([rng.randrange(n)], rng.sample(range(n), rng.randint(0, min(4, n)))) for _ in range(rng.randint(5, 40))]
        path = _steps(tmp_path, records, f"b{trial}.jsonl")
        expected = _libcachesim_read_hits(path, records, capacity)
        if expected is None:
            break
        assert _run(path, "belady", capacity).hits == expected, (trial, capacity, records)


def test_export_of_a_step_past_32_bits_names_the_file_line_and_why(tmp_path, capsys):
    path = tmp_path / "big.jsonl"
    path.write_text('{"block_tokens": 16}\n{"step": 0, "layer": 0, "read": [], "write": [1]}\n\n'
                    '{"step": 4294967295, "layer": 0, "read": [1], "write": []}\n'
                    '{"step": 4294967296, "layer": 0, "read": [1], "write": []}\n')
    with pytest.raises(UserError, match=rf"^{path}:5: step 4294967296 .*32-bit"):
        export_trace(load_trace(path), tmp_path / "out.og")
    assert cli_main(["trace", "export", str(path), "-o", str(tmp_path / "cli.og")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path}:5: step 4294967296" in err and "2**32" in err
    assert not (tmp_path / "cli.og").exists()
