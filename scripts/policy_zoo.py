#!/usr/bin/env python3
"""Policy zoo: how much of the LRU-to-Belady gap the field's known online policies close.

Every online eviction policy tiercache registers, and every online policy of libCacheSim's
that needs no training or tuning, replays the same trace at the same capacities in object
semantics (one access per block id, one tier; libCacheSim has no prefix semantics). Gap
closed = (miss_LRU - miss_P) / (miss_LRU - miss_Belady), with LRU and Belady from tiercache's
replay. Both sides' LRU and Belady are replayed, and their miss counts must agree (a check of
the common ground: the script exits 1 when they differ). This is the evidence behind "no
known online policy reaches 30% here": it puts tiercache's best next to nineteen others.
Below the capacity a libCacheSim policy's own sizing needs (``LIBCACHESIM_MIN_CAPACITY``:
its fixed shares of the cache round to too few blocks, and it misses every access, or, for
S3-FIFO below 10 blocks, aborts the process) that policy is not run there: the output names
it, and it is not ranked.

Left out of libCacheSim's set: its learned policies (GLCache, LRB, 3L-Cache: their training
intervals are set for day-long CDN traces, and they learn nothing on a trace of minutes) and
its size-aware ones (GDSF, AdaptSize: every block here has one size). ``Belady`` and
``BeladySize`` are offline.

    python scripts/policy_zoo.py                      # bundled Mooncake sample + kv-cache-tester sample
    python scripts/policy_zoo.py --trace T --capacity 1000,4000,16000 --json zoo.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from tiercache.bench.rounds import positive_int
from tiercache.bench.script_args import (ScriptParser, add_trace_capacities, refuse_bad_outputs, request_traces, trace_of,
                                         trace_pairs)
from tiercache.errors import UserError
from tiercache.report.fmt import percent_or_na
from tiercache.report.summary import BASELINE, best_per_capacity
from tiercache.policies import EVICTION, get_eviction
from tiercache.results import Semantics
from tiercache.results.outfile import replace_file
from tiercache.sim.loader import Trace, load_request_trace
from tiercache.sim.oracle import LIBCACHESIM_MIN_CAPACITY, export_trace, libcachesim_runs_at
from tiercache.sim.sweep import SweepSpec, sweep

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULTS = [(os.path.join(HERE, "..", "tests", "data", "mooncake_synthetic_trace.jsonl"), [1000, 4000, 16000]),
            (os.path.join(HERE, "..", "tests", "data", "kvtester_sample"), [500, 1000, 2000])]
#: libCacheSim's online policies that take a cache size and nothing else (their defaults).
LIBCACHESIM_ONLINE = ("FIFO", "Clock", "Sieve", "LFU", "LFUDA", "LRUK", "TwoQ", "SLRU", "ARC", "LIRS", "ClockPro",
                      "Clock2QPlus", "MQ", "S3FIFO", "WTinyLFU", "LeCaR", "Cacheus", "LHD", "Hyperbolic")
#: The two sides of the common ground, checked count for count.
CHECKED = {"lru": "LRU", "belady": "Belady"}
#: libCacheSim's policies with fixed shares of the cache run only from a size up
#: (``tiercache.sim.oracle.LIBCACHESIM_MIN_CAPACITY``).
runs_at = libcachesim_runs_at


def online_policies() -> tuple[str, ...]:
    """tiercache's registered eviction policies that do not read the future."""
    return tuple(name for name in EVICTION if not get_eviction(name).needs_future)


def tiercache_misses(trace: Trace, capacities: list[int], workers: int) -> tuple[dict[tuple[str, int], tuple[int, int]],
                                                                                 dict[int, str]]:
    """(policy, capacity) -> (misses, accesses) of tiercache's replay, object semantics, one tier,
    and its best online policy per capacity as tiercache's reports name it (``best_per_capacity``:
    ties go to LRU, then to the alphabetically first)."""
    policies = tuple(dict.fromkeys(("lru", "belady", *online_policies())))
    runs = sweep(trace, SweepSpec(policies, (Semantics.OBJECT,), tuple(capacities)), workers).runs
    best = {entry.capacity_blocks: entry.best.policy for entry in best_per_capacity(runs)}
    return {(r.policy, r.capacity_blocks): (r.misses, r.accesses) for r in runs}, best


def tie_order(entry: tuple[str, str, int]) -> tuple:
    """The order of (side, policy, misses) entries of one capacity: fewest misses first, ties to
    LRU, then to the policy first in alphabetical order (any case), then to tiercache's side: the
    rule of tiercache's reports (``best_per_capacity``), whose references every entry shares."""
    side, policy, misses = entry
    return misses, policy.casefold() != BASELINE, policy.casefold(), side != "tiercache"


def libcachesim_misses(trace: Trace, capacities: list[int]) -> dict[tuple[str, int], tuple[int, int]]:
    """(policy, capacity) -> (misses, accesses) of libCacheSim's C replay of the same trace
    (the loaded ``trace`` exported to oracleGeneral, which carries next-use times for its Belady)."""
    import libcachesim as lcs

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        oracle = os.path.join(tmp, "trace.oracleGeneral")
        export_trace(trace, oracle)
        for name in (*CHECKED.values(), *LIBCACHESIM_ONLINE):
            for capacity in (c for c in capacities if runs_at(name, c)):
                cache = getattr(lcs, name)(cache_size=capacity)
                miss_ratio, _ = cache.process_trace(lcs.TraceReader(oracle, lcs.TraceType.ORACLE_GENERAL_TRACE))
                accesses = int(cache._cache.n_req)  # no public getter in the Python wrapper
                out[(name, capacity)] = (round(float(miss_ratio) * accesses), accesses)
    return out


def zoo_rows(path: str, trace: Trace, capacities: list[int], workers: int) -> tuple[list[dict], list[str]]:
    """One row per (capacity, policy) of both sides, best first within a capacity (``tie_order``;
    each side's first row is its best, tiercache's the one its reports name; libCacheSim's
    policies not run there, ``runs_at``, have none), and the problems found checking the
    common ground (empty when LRU and Belady agree)."""
    (ours, best), theirs = tiercache_misses(trace, capacities, workers), libcachesim_misses(trace, capacities)
    name = os.path.basename(os.path.normpath(path))
    rows, problems = [], []
    for capacity in capacities:
        for policy, their_name in CHECKED.items():
            if ours[(policy, capacity)] != theirs[(their_name, capacity)]:
                problems.append(f"{name} at {capacity}: {policy} misses/accesses {ours[(policy, capacity)]} here, "
                                f"{theirs[(their_name, capacity)]} in libCacheSim")
        (lru, accesses), (belady, _) = ours[("lru", capacity)], ours[("belady", capacity)]
        entries = [("tiercache", p, ours[(p, capacity)][0]) for p in online_policies()]
        entries += [("libCacheSim", p, theirs[(p, capacity)][0]) for p in LIBCACHESIM_ONLINE if runs_at(p, capacity)]
        entries.sort(key=tie_order)
        first = next(policy for side, policy, _ in entries if side == "tiercache")
        if first != best[capacity]:  # the two statements of the tie rule disagree
            problems.append(f"{name} at {capacity}: tiercache's reports name {best[capacity]} its best online policy, "
                            f"the zoo's order {first}")
        for side, policy, misses in entries:
            gap = (lru - misses) / (lru - belady) if lru > belady else None  # n/a: LRU already optimal
            rows.append({"workload": name, "capacity": capacity, "side": side, "policy": policy,
                         "miss_ratio": misses / accesses, "lru": lru / accesses, "belady": belady / accesses,
                         "gap_closed": gap})
    return rows, problems


def print_rows(rows: list[dict], top: int) -> None:
    """Per (workload, capacity): LRU and Belady, the ``top`` best policies, and the best of
    each side."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["capacity"]), []).append(row)
    for (workload, capacity), group in groups.items():
        print(f"\n{workload} at {capacity} blocks: LRU {group[0]['lru']:.4f}, Belady {group[0]['belady']:.4f} (miss ratios)")
        skipped = [name for name in LIBCACHESIM_ONLINE if not runs_at(name, capacity)]
        if skipped:
            print(f"  not run: libCacheSim's {', '.join(skipped)} (their sizing needs more blocks: "
                  f"{', '.join(f'{n} {LIBCACHESIM_MIN_CAPACITY[n]}' for n in skipped)})")
        for row in group[:top]:
            print(f"  {row['side']:11} {row['policy']:12} {row['miss_ratio']:.4f}  gap closed {percent_or_na(row['gap_closed']):>6}")
        for side in ("tiercache", "libCacheSim"):
            best = next(r for r in group if r["side"] == side)
            print(f"  best of {side}: {best['policy']} {percent_or_na(best['gap_closed'])}")



def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__.split("\n")[0])
    add_trace_capacities(parser)
    parser.add_argument("--workers", type=positive_int, default=2, help="processes for tiercache's sweep")
    parser.add_argument("--top", type=positive_int, default=8, help="policies printed per capacity")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    args.pairs = trace_pairs(parser, args, DEFAULTS)
    refuse_bad_outputs(parser, {"--json": args.json}, inputs=[path for path, _ in args.pairs])
    args.traces = request_traces(parser, [path for path, _ in args.pairs], load_request_trace)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, problems = [], []
    try:
        for path, capacities in args.pairs:
            more, found = zoo_rows(path, trace_of(args.traces, path, load_request_trace), capacities, args.workers)
            rows += more
            problems += found
    except UserError as exc:
        print(f"policy_zoo: {exc}", file=sys.stderr)
        return 2
    print_rows(rows, args.top)
    if args.json:  # whole or not at all
        skipped = {name: least for name, least in LIBCACHESIM_MIN_CAPACITY.items()
                   if any(not runs_at(name, c) for _, capacities in args.pairs for c in capacities)}
        replace_file(args.json, json.dumps({"rows": rows, "problems": problems, "libcachesim_min_capacity": skipped},
                                           indent=2, allow_nan=False), f"--json {args.json}")
    for problem in problems:
        print(f"MISMATCH: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("policy_zoo: interrupted", file=sys.stderr)
        sys.exit(130)
