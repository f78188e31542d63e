"""Overlap of I/O and compute in an exact decode step with the KV spilled to NVMe.

In one run, on the same sequence, a layer's exact attention is timed three ways
(``tiercache.bench.decode.step_timings``, medians of ``--repeats``):

* ``io_only``: every NVMe chunk read into the window with the pipeline's schedule, nothing
  converted or computed (NVMe reads are O_DIRECT: cold every time, no page cache);
* ``compute_only``: the same chunks, same sizes, converted and computed from memory;
* ``pipelined``: the real ``Sequence.attend``, reads of chunk ``i+1..`` overlapping the
  compute of chunk ``i``.

``overlap_efficiency = max(io_only, compute_only) / pipelined`` (1.0: the shorter side is
completely hidden). Every pipelined output must match the same attention computed serially
(untimed), and an efficiency above ``OVERLAP_LIMIT`` (1.5: the pipelined step cannot beat
the longer side of the same work) is refused: the script exits 1 and writes no JSON. The
figure only says something about overlap when both sides are of similar size, so the query
heads (compute grows with them, I/O does not) are calibrated first until
``io_only / compute_only`` lies within [0.5, 2] (``--q-heads`` fixes them instead).

The default layout is one layer of llama-3-8b (8 KV heads, head dim 128: 1 MiB blocks of 256
tokens), what a real model's per-layer blocks weigh. Small blocks (``--kv-heads 2 --head-dim
64``: 128 KiB) make the read CPU-bound on a small machine: each block costs its I/O thread
about 50 us of Python and syscalls whatever its size, time the compute thread then competes for.

Usage: ``python scripts/bench_decode.py [--tokens 262144] [--repeats 7] [--json OUT]``
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile

import torch

from tiercache import TieredKVCache
from tiercache.bench.decode import NeedleKV, StepCheckError, balance_verdict, cpu_count, overlap_problem, step_timings
from tiercache.bench.rounds import positive_int
from tiercache.config import KVLayout, TierConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=positive_int, default=262_144,
                        help="default 262,144: 1 GiB of KV, 1,024 blocks (at least one block)")
    parser.add_argument("--block-tokens", type=positive_int, default=256)
    parser.add_argument("--kv-heads", type=positive_int, default=8,
                        help="default 8 (with --head-dim 128: one llama-3-8b layer)")
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--q-heads", type=positive_int, default=None,
                        help="query heads, a multiple of --kv-heads (default: calibrated)")
    parser.add_argument("--window-blocks", type=positive_int, default=32)
    parser.add_argument("--depth", type=positive_int, default=4)
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--path", default=None, help="folder for the temporary NVMe store")
    parser.add_argument("--threads", type=positive_int, default=max(1, cpu_count() - 1),
                        help="torch compute threads (default: all CPUs but one, which serves the NVMe I/O threads)")
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args(argv)
    if args.tokens < args.block_tokens:
        parser.error(f"--tokens: at least one block of --block-tokens {args.block_tokens}, got {args.tokens}")
    if args.q_heads is not None and args.q_heads % args.kv_heads:
        parser.error(f"--q-heads: a multiple of --kv-heads {args.kv_heads}, got {args.q_heads}")
    return args


def calibrate(seq, kv: NeedleKV, args) -> tuple[int, dict]:
    """The query-head count (compute grows with it, I/O does not) whose I/O-to-compute
    ratio is closest to 1, trying counts upward until compute dominates."""
    best = None
    for heads in (2, 4, 8, 16, 32, 64, 128):
        if heads % args.kv_heads:
            continue
        q, _ = kv.query(0, heads)
        timing = step_timings(seq, 0, q, repeats=2)
        distance = abs(math.log(timing["io_compute_ratio"]))
        if best is None or distance < best[2]:
            best = (heads, timing, distance)
        if timing["io_compute_ratio"] < 1.0:  # compute dominates from here on
            break
    return best[0], best[1]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    layout = KVLayout(1, args.kv_heads, args.head_dim, "float16", args.block_tokens, per_layer=True, name="bench-decode")
    blocks = args.tokens // args.block_tokens
    tiers = [TierConfig("hbm", 8), TierConfig("dram", 8), TierConfig("nvme", blocks + 64)]
    kv = NeedleKV(blocks * args.block_tokens, args.kv_heads, args.head_dim, args.block_tokens, 4, 0)
    folder = tempfile.mkdtemp(prefix="tiercache-bench-decode-", dir=args.path)
    try:
        with TieredKVCache(layout, tiers, prefetch="none", path=folder, window_blocks=args.window_blocks, depth=args.depth,
                           write_through=True) as cache:
            seq = cache.sequence()
            for a in range(0, kv.n_blocks * args.block_tokens, 1 << 16):
                seq.append(0, *kv.chunk(a, min(1 << 16, kv.n_blocks * args.block_tokens - a)))
            heads = args.q_heads
            try:
                if heads is None:
                    heads, _ = calibrate(seq, kv, args)
                q, _ = kv.query(0, heads)
                timing = step_timings(seq, 0, q, repeats=args.repeats)
            except StepCheckError as error:
                print(f"error: {error}; no figures reported", file=sys.stderr)
                return 1
            on_nvme = cache.manager.dirs[2].capacity and sum(1 for b in seq._layers[0].ids[: seq.blocks(0)]
                                                            if cache.manager.locate(int(b)) == 2)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    balanced = timing["balanced"]
    figures = {"tokens": kv.n_blocks * args.block_tokens, "blocks": kv.n_blocks, "blocks_read_from_nvme": on_nvme,
               "kv_bytes": kv.n_blocks * layout.block_bytes, "q_heads": heads, "kv_heads": args.kv_heads,
               "window_blocks": args.window_blocks, "depth": args.depth, "repeats": args.repeats,
               "io_only": timing["io_only_seconds"], "compute_only": timing["compute_only_seconds"],
               "pipelined": timing["pipelined_seconds"], "overlap_efficiency": timing["overlap_efficiency"],
               "io_compute_ratio": timing["io_compute_ratio"], "balanced": balanced,
               "output_rel_err": timing["output_rel_err"], "cpus": cpu_count(),
               "torch_threads": torch.get_num_threads()}
    for name in ("io_only", "compute_only", "pipelined"):
        print(f"{name:<14} {figures[name]:.4f} s")
    print(f"{'io/compute':<14} {figures['io_compute_ratio']:.2f} ({balance_verdict(figures['io_compute_ratio'])})")
    print(f"{'overlap':<14} {figures['overlap_efficiency']:.3f}  (q_heads={heads}, {on_nvme:,} of {kv.n_blocks:,} blocks on NVMe)")
    problem = overlap_problem(timing)
    if problem:
        print(f"error: {problem}; no figures written", file=sys.stderr)
        return 1
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
