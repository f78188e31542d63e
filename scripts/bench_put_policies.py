#!/usr/bin/env python3
"""What each eviction policy costs the live store's put, against lru in the same run.

Usage: python scripts/bench_put_policies.py [--policy lru,arc,...] [--slots 2000] [--batch 100] [--reps 5] [--json out.json]

A ``TieredKVStore`` (CPU device: HBM and DRAM of ``--slots`` blocks each, a small layout, so
the bytes cost little and the manager's work shows) is filled to a full HBM, then each timed
call puts ``--batch`` new keys: every one pushes an HBM block down to DRAM. A policy whose
``batch_insert_safe`` is False (all but lru and fifo) places them one at a time, one victim,
one demotion and one fill each (sequential code's decisions, so the live store counts what a
replay counts); lru and fifo place the batch at once.

Honest by construction: every policy's store is built and filled the same way, the timed
puts of one round run every policy once with the first one rotating
(``tiercache.bench.rounds.alternate``), each call's blocks are read back after the clock and
compared with what was put (a put that stored other bytes ends the run with exit 1), and the
figures are medians of each policy's per-round median, with the ratio to lru taken per round.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from tiercache.bench.rounds import alternate, positive_int
from tiercache.bench.script_args import ScriptParser, refuse_bad_outputs, run_script
from tiercache.results.outfile import replace_file
from tiercache.config import KVLayout, TierConfig
from tiercache.live.store import TieredKVStore
from tiercache.policies import EVICTION, get_eviction

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
DEFAULT_POLICIES = "lru,fifo,arc,s3fifo,sieve,lfu,leaf_lru,cost,session"


def parse(argv: list[str]):
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default=DEFAULT_POLICIES, help="comma list of online eviction policies (lru first)")
    parser.add_argument("--slots", type=positive_int, default=2000, help="blocks of HBM, and of DRAM")
    parser.add_argument("--batch", type=positive_int, default=100, help="new keys per put")
    parser.add_argument("--reps", type=positive_int, default=5, help="rounds")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    args.policies = [p.strip().lower() for p in args.policy.split(",") if p.strip()]
    unknown = [p for p in args.policies if p not in EVICTION or get_eviction(p).needs_future]
    if unknown or not args.policies or args.policies[0] != "lru":
        parser.error(f"--policy: online registered policies, lru first; got {args.policy!r}")
    if args.batch > args.slots:  # the timed puts are whole batches of the --slots new keys
        parser.error(f"--batch {args.batch}: at most --slots {args.slots} (each timed put is one batch of the "
                     f"{args.slots} new keys)")
    refuse_bad_outputs(parser, {"--json": args.json})
    return args


def one_round(policy: str, args, round_index: int) -> float:
    """A fresh store with a full HBM, then ``slots // batch`` timed puts of new keys; returns
    the median seconds of one put. Raises SystemExit(1) when a put stored other bytes."""
    store = TieredKVStore(LAYOUT, [TierConfig("hbm", args.slots), TierConfig("dram", args.slots)],
                          eviction=policy, device="cpu")
    gen = torch.Generator().manual_seed(round_index)
    keys = [(round_index << 40 | i).to_bytes(16, "little") for i in range(2 * args.slots)]
    try:
        for start in range(0, args.slots, args.batch):  # fills HBM
            store.put(keys[start : start + args.batch], torch.randn((len(keys[start : start + args.batch]),
                                                                     *LAYOUT.block_shape), generator=gen).half())
        seconds = []
        for start in range(args.slots, 2 * args.slots - args.batch + 1, args.batch):
            batch = keys[start : start + args.batch]
            data = torch.randn((len(batch), *LAYOUT.block_shape), generator=gen).half()
            began = time.perf_counter()
            store.put(batch, data)
            seconds.append(time.perf_counter() - began)
            if not torch.equal(store.get(batch), data):
                print(f"{policy}: a put stored other bytes than it was given", file=sys.stderr)
                raise SystemExit(1)
        return statistics.median(seconds)
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    rounds = alternate({p: (lambda i, p=p: one_round(p, args, i)) for p in args.policies}, args.reps)
    ratios = {p: statistics.median(a / b for a, b in zip(rounds[p], rounds["lru"])) for p in args.policies}
    print(f"put of {args.batch} new keys into a full HBM ({args.slots} blocks; DRAM {args.slots}), CPU device, "
          f"median of {args.reps} rounds")
    print(f"{'policy':<10} {'ms/put':>8} {'x lru':>7}  places")
    figures = {}
    for policy in args.policies:
        ms = 1e3 * statistics.median(rounds[policy])
        safe = get_eviction(policy).batch_insert_safe
        figures[policy] = {"ms_per_put": ms, "ratio_to_lru": ratios[policy], "batch_insert_safe": safe}
        print(f"{policy:<10} {ms:8.2f} {ratios[policy]:7.2f}  {'the batch at once' if safe else 'one at a time'}")
    if args.json:  # whole or not at all
        replace_file(args.json, json.dumps({"slots": args.slots, "batch": args.batch, "reps": args.reps,
                                            "policies": figures}, indent=1), f"--json {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
