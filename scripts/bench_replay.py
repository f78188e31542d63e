#!/usr/bin/env python3
"""Replay throughput: tiercache's manager vs libCacheSim's C loop, side by side in one run.

Usage: python scripts/bench_replay.py [--trace T] [--repeats 5] [--json out.json]

1. LRU, object semantics, one tier of 4,000 blocks on the sample trace: block accesses per
   second through ``tiercache.sim.replay.replay`` (the real manager and SimEngine; trace
   already parsed) and through ``libcachesim.LRU.process_trace`` on the same trace exported
   as oracleGeneral (reader already opened); medians of ``--repeats`` runs and their ratio.
2. The sweep of 7 eviction policies x 3 capacities (1,000 / 4,000 / 16,000 blocks), wall
   time with one worker per core, as ``tiercache replay`` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiercache.results import RunRecord

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl"
SWEEP_POLICIES = ["lru", "fifo", "lfu", "arc", "s3fifo", "sieve", "belady"]
SWEEP_CAPACITIES = [1000, 4000, 16000]


def time_tiercache(trace: str, capacity: int, repeats: int) -> tuple[list[float], RunRecord]:
    """Seconds per replay through the manager (trace loaded once, outside the timing)."""
    from tiercache.config import TierConfig
    from tiercache.results import Semantics
    from tiercache.sim.loader import load_trace
    from tiercache.sim.replay import ReplayData, RunSpec, replay

    data = ReplayData.prepare(load_trace(trace), None, None)
    spec = RunSpec("lru", Semantics.OBJECT, (TierConfig("hbm", capacity),))
    times, record = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        record = replay(spec, data)
        times.append(time.perf_counter() - started)
    return times, record


def time_libcachesim(trace: str, capacity: int, repeats: int) -> tuple[list[float], float] | None:
    """Seconds per ``process_trace`` of libCacheSim's LRU, or None when it is not installed."""
    try:
        import libcachesim as lcs
    except ImportError:
        return None
    from tiercache.sim.oracle import export_oracle_general

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.oracleGeneral")
        export_oracle_general(trace, path)
        times, miss_ratio = [], 0.0
        for _ in range(repeats):
            reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
            # hashpower 20 (1M buckets) holds the trace's 44k objects; the default 24 spends
            # most of a short run allocating a 16M-bucket table, which would flatter us.
            cache = lcs.LRU(cache_size=capacity, hashpower=20)
            started = time.perf_counter()
            miss_ratio, _ = cache.process_trace(reader)
            times.append(time.perf_counter() - started)
    return times, miss_ratio


def time_sweep(trace: str) -> tuple[float, int]:
    """Wall seconds of the 7 x 3 sweep with one worker per core."""
    from tiercache.results import Semantics
    from tiercache.sim.loader import load_trace
    from tiercache.sim.sweep import SweepSpec, sweep

    started = time.perf_counter()
    spec = SweepSpec(tuple(SWEEP_POLICIES), (Semantics.OBJECT,), tuple(SWEEP_CAPACITIES))
    doc = sweep(load_trace(trace), spec, workers=os.cpu_count() or 1)
    return time.perf_counter() - started, len(doc.runs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--capacity", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    ours, record = time_tiercache(args.trace, args.capacity, args.repeats)
    accesses = record.accesses
    ours_rate = accesses / statistics.median(ours)
    result = {"trace": args.trace, "accesses": accesses, "capacity": args.capacity, "repeats": args.repeats,
              "tiercache": {"median_s": statistics.median(ours), "accesses_per_s": ours_rate, "miss_ratio": record.miss_ratio}}
    theirs = time_libcachesim(args.trace, args.capacity, args.repeats)
    if theirs is not None:
        times, miss_ratio = theirs
        rate = accesses / statistics.median(times)
        result["libcachesim"] = {"median_s": statistics.median(times), "accesses_per_s": rate, "miss_ratio": miss_ratio}
        result["ratio_tiercache_to_libcachesim"] = ours_rate / rate
    sweep_s, runs = time_sweep(args.trace)
    result["sweep"] = {"policies": SWEEP_POLICIES, "capacities": SWEEP_CAPACITIES, "runs": runs, "wall_s": sweep_s,
                       "workers": os.cpu_count()}
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def print_table(result: dict) -> None:
    print(f"LRU, object semantics, {result['capacity']} blocks, {result['accesses']} block accesses, "
          f"median of {result['repeats']} runs")
    print(f"{'engine':<14} {'seconds':>9} {'accesses/s':>13} {'miss ratio':>11}")
    for name in ("tiercache", "libcachesim"):
        if name in result:
            row = result[name]
            print(f"{name:<14} {row['median_s']:>9.4f} {row['accesses_per_s']:>13,.0f} {row['miss_ratio']:>11.6f}")
    if "ratio_tiercache_to_libcachesim" in result:
        ratio = result["ratio_tiercache_to_libcachesim"]
        print(f"tiercache / libCacheSim throughput: {ratio:.3f} (libCacheSim is {1 / ratio:.1f}x faster)")
    else:
        print("libcachesim not installed: no side-by-side ratio")
    sweep = result["sweep"]
    print(f"sweep {len(sweep['policies'])} policies x {len(sweep['capacities'])} capacities = {sweep['runs']} runs: "
          f"{sweep['wall_s']:.2f} s wall with {sweep['workers']} workers")


if __name__ == "__main__":
    sys.exit(main())
