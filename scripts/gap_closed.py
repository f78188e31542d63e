#!/usr/bin/env python3
"""Gap closed: how much of the LRU-to-Belady miss-ratio gap each policy closes, per workload.

Every figure comes from the same sweep ``tiercache replay`` runs (the manager, prefix
semantics, default policy parameters, the whole trace): gap closed = (miss_LRU - miss_P) /
(miss_LRU - miss_Belady). Then a 3-tier hierarchy (hbm, dram, nvme) with a model and a
hardware profile, reporting the modeled TTFT saved of each policy against LRU, with the default
placement and with ``--placement reuse`` (labelled ``policy@reuse``).

    python scripts/gap_closed.py                       # bundled Mooncake sample + kv-cache-tester sample
    python scripts/gap_closed.py --trace T1 --capacity 1000,4000,16000 --trace T2 --capacity 500,2000,8000
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tiercache.bench.rounds import positive_int
from tiercache.bench.script_args import (ScriptParser, add_trace_capacities, refuse_bad_outputs, request_traces, trace_of,
                                         trace_pairs)
from tiercache.config import CacheConfig, TierConfig, layout_preset
from tiercache.errors import UserError
from tiercache.report.fmt import percent_or_na
from tiercache.results import Semantics
from tiercache.results.outfile import replace_file
from tiercache.sim.hardware import load_profile
from tiercache.sim.loader import Trace, load_request_trace
from tiercache.sim.sweep import SweepSpec, sweep

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULTS = [(os.path.join(HERE, "..", "tests", "data", "mooncake_synthetic_trace.jsonl"), [1000, 4000, 16000]),
            (os.path.join(HERE, "..", "tests", "data", "kvtester_sample"), [500, 1000, 2000])]
POLICIES = ("session", "cost", "leaf_lru", "arc", "s3fifo", "lfu")
#: Placements of the 3-tier rows (``lru`` with the default one is the baseline).
PLACEMENTS = ("top", "reuse")
#: The 3-tier rows' HBM tier is a quarter of the middle capacity: it needs at least this many blocks.
MIN_MIDDLE = 4
#: The model and hardware of the 3-tier rows.
MODEL, HARDWARE = "llama-3-8b", "h200-pcie5-nvme4"


def gap_rows(path: str, trace: Trace, capacities: list[int], policies: tuple[str, ...], workers: int) -> list[dict]:
    """One row per (capacity, policy) of ``trace`` (read from ``path``): LRU, policy and Belady
    miss ratios and the gap closed (None where LRU misses no more than Belady: no gap to
    close, "n/a" as the reports say)."""
    spec = SweepSpec(("lru", "belady", *policies), (Semantics.PREFIX,), tuple(capacities))
    runs = sweep(trace, spec, workers).runs
    miss = {(r.policy, r.capacity_blocks): r.miss_ratio for r in runs}
    rows = []
    for cap in capacities:
        lru, bel = miss[("lru", cap)], miss[("belady", cap)]
        for policy in policies:
            gap = (lru - miss[(policy, cap)]) / (lru - bel) if lru > bel else None
            rows.append({"workload": os.path.basename(os.path.normpath(path)), "capacity": cap, "policy": policy,
                         "lru": lru, "miss": miss[(policy, cap)], "belady": bel, "gap_closed": gap})
    return rows


def ttft_rows(path: str, trace: Trace, tiers: tuple[int, int, int], policies: tuple[str, ...], workers: int) -> list[dict]:
    """Modeled TTFT saved (s) of each policy on a 3-tier exclusive hierarchy, with the default
    placement and with ``reuse``, and its gain over LRU with the default placement."""
    runs = {}
    for spec in ttft_specs(tiers, policies, trace.block_tokens):
        runs |= {r.label: r for r in sweep(trace, spec, workers).runs}
    base = runs["lru"].ttft_saved_s
    return [{"workload": os.path.basename(os.path.normpath(path)), "tiers": "/".join(map(str, tiers)), "policy": label,
             "miss": run.miss_ratio, "ttft_saved_s": run.ttft_saved_s, "vs_lru_s": run.ttft_saved_s - base}
            for label, run in runs.items() if label != "lru"]


def ttft_specs(tiers: tuple[int, int, int], policies: tuple[str, ...], block_tokens: int | None) -> list[SweepSpec]:
    """The sweeps of the 3-tier rows, one per placement.

    Raises:
        UserError: a policy name the sweep refuses (unknown, offline with ``reuse``...).
    """
    layout = layout_preset(MODEL, block_tokens)
    cache = CacheConfig(tuple(TierConfig(n, c) for n, c in zip(("hbm", "dram", "nvme"), tiers)))
    profile = load_profile(HARDWARE).require_prefill()
    return [SweepSpec(("lru", *policies), (Semantics.PREFIX,), (), cache, "always", layout, profile, placement=placement)
            for placement in PLACEMENTS]


def three_tiers(capacities: list[int]) -> tuple[int, int, int]:
    """The 3-tier row's (hbm, dram, nvme) blocks: a quarter, one and four times the middle
    capacity (of the capacities sorted; of two, the larger)."""
    mid = sorted(capacities)[len(capacities) // 2]
    return mid // 4, mid, 4 * mid


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, every one checked before any replay: a bad one ends in one line (exit 2)."""
    parser = ScriptParser(description=__doc__.split("\n")[0])
    add_trace_capacities(parser)
    parser.add_argument("--policy", default=",".join(POLICIES))
    parser.add_argument("--workers", type=positive_int, default=2)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    args.pairs = trace_pairs(parser, args, DEFAULTS)
    for path, capacities in args.pairs:
        if three_tiers(capacities)[0] < 1:
            parser.error(f"--capacity {','.join(map(str, capacities))}: the 3-tier rows put a quarter of the middle "
                         f"capacity ({three_tiers(capacities)[1]}) in HBM; give a middle capacity of at least "
                         f"{MIN_MIDDLE} blocks")
    try:  # the names as registered (``ARC`` is ``arc``), which the runs carry
        named = SweepSpec(("lru", "belady", *args.policy.split(",")), (Semantics.PREFIX,), (1,)).policies[2:]
        args.policies = tuple(dict.fromkeys(p for p in named if p not in ("lru", "belady")))  # the gap's ends
        ttft_specs((1, 1, 1), args.policies, None)
    except UserError as exc:
        parser.error(f"--policy {args.policy}: {exc}")
    for _, capacities in args.pairs:  # capacities a sweep refuses, before the first table
        try:
            SweepSpec(("lru",), (Semantics.PREFIX,), tuple(capacities))
        except UserError as exc:
            parser.error(f"--capacity {','.join(map(str, capacities))}: {exc}")
    if not args.policies:
        parser.error(f"--policy {args.policy}: no policy to compare (lru and belady are the gap's ends)")
    refuse_bad_outputs(parser, {"--json": args.json}, inputs=[path for path, _ in args.pairs])
    args.traces = request_traces(parser, [path for path, _ in args.pairs], load_request_trace)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gaps, ttft = [], []
    try:
        for path, capacities in args.pairs:
            trace = trace_of(args.traces, path, load_request_trace)
            for row in gap_rows(path, trace, capacities, args.policies, args.workers):
                if not gaps:  # after the first sweep: a capacity it refuses ends in its line alone
                    print(f"{'workload':32} {'capacity':>8} {'policy':10} {'LRU':>7} {'policy':>7} {'Belady':>7} {'gap closed':>10}")
                gaps.append(row)
                print(f"{row['workload'][:32]:32} {row['capacity']:>8} {row['policy']:10} {row['lru']:7.4f} "
                      f"{row['miss']:7.4f} {row['belady']:7.4f} {percent_or_na(row['gap_closed']):>10}")
            ttft.extend(ttft_rows(path, trace, three_tiers(capacities), args.policies, args.workers))
            del trace  # one trace in memory at a time
    except UserError as exc:
        print(f"gap_closed: {exc}", file=sys.stderr)
        return 2
    print(f"\n3 tiers (hbm/dram/nvme blocks), {MODEL} on {HARDWARE}, prefix semantics:")
    print(f"{'workload':32} {'tiers':>16} {'policy':15} {'miss':>7} {'TTFT saved s':>12} {'vs LRU s':>9}")
    for row in ttft:
        print(f"{row['workload'][:32]:32} {row['tiers']:>16} {row['policy']:15} {row['miss']:7.4f} {row['ttft_saved_s']:12.2f} "
              f"{row['vs_lru_s']:+9.2f}")
    if args.json:  # whole or not at all; strict JSON: no gap is null
        replace_file(args.json, json.dumps({"gap_closed": gaps, "ttft": ttft}, indent=2, allow_nan=False), f"--json {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("gap_closed: interrupted", file=sys.stderr)
        sys.exit(130)
