"""Overlap of I/O and compute in an exact decode step with the KV spilled to NVMe.

In one run, on the same sequence, a layer's exact attention is timed three ways
(``tiercache.bench.decode.step_timings``, medians of ``--repeats``):

* ``io_only``: every NVMe chunk read into the window with the pipeline's schedule and waited
  for, nothing copied, converted or computed (the compute-only pass's blocks are copied before
  the clock starts). NVMe reads are O_DIRECT where the filesystem allows it, and cold: before
  this region and before the pipelined one the chunk files are evicted from the page cache
  (``POSIX_FADV_DONTNEED``, the store's own files only) and ``mincore`` must find none of
  their bytes cached (``tiercache.bench.decode.make_cold``), or the run exits 1 with no
  figures: a store on a memory filesystem (``--path /dev/shm``, tmpfs) would time RAM;
* ``compute_only``: the same chunks, same sizes, converted and computed from memory;
* ``pipelined``: the real ``Sequence.attend``, reads of chunk ``i+1..`` overlapping the
  compute of chunk ``i``.

``overlap_efficiency = max(io_only, compute_only) / pipelined``, the median of each repeat's
own ratio (1.0: the shorter side is completely hidden). Every pipelined output must match the same attention computed serially
(untimed), and an efficiency above ``OVERLAP_LIMIT`` (1.1: the pipelined step cannot beat
the longer side of the same work, and 10% covers the timing noise) is refused: the script
exits 1 and writes no JSON. The figure only says something about overlap when both sides are of similar size, so the query
heads are calibrated first until ``io_only / compute_only`` lies within [0.5, 2]
(``BALANCED_RATIO``). I/O does not depend on them; compute does, but weakly: a chunk's
fp16 -> fp32 conversion, the same for any head count, is most of it at a model's own 8-32
heads (16x the heads gave 1.9x the compute), so the calibration doubles them from
``--kv-heads`` up to ``MAX_GROUP`` query heads per KV head (a head beyond a model's own
stands for one more query row reading the same KV, as ``Sequence.attend_partial``'s query
tokens do), on medians of ``CALIBRATION_REPEATS`` timings, and keeps the count whose ratio
is closest to 1. When the measured step is still outside the band, the count moves one
doubling towards it and the step is measured again, ``SETTLE_STEPS`` times at most; a
calibrated run that still ends outside the band exits 1 and writes no JSON (its figure
would not be the balanced one it stands for). ``--q-heads`` fixes the heads instead: the
run then reports whatever ratio they give, with its verdict (``balanced`` in the JSON).

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
from tiercache.bench.decode import (ColdReadError, NeedleKV, StepCheckError, balance_verdict, check_cold_possible, cpu_count,
                                    overlap_problem, step_timings)
from tiercache.bench.rounds import positive_int
from tiercache.bench.script_args import ScriptParser, existing_folder, refuse_bad_outputs
from tiercache.config import KVLayout, TierConfig

#: Calibration tries up to this many query heads per KV head (``kv_heads * MAX_GROUP`` in all).
MAX_GROUP = 512
#: Timings per calibration candidate: their median (two gave non-monotonic ratios).
CALIBRATION_REPEATS = 3
#: Re-measurements, one doubling or halving of the heads each, when the measured step lies
#: outside ``BALANCED_RATIO``.
SETTLE_STEPS = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    parser.add_argument("--path", type=existing_folder, default=None,
                        help="folder on the disk to time for the temporary NVMe store (default: the system temp "
                             "folder); a memory filesystem such as /dev/shm is refused (exit 1)")
    parser.add_argument("--threads", type=positive_int, default=max(1, cpu_count() - 1),
                        help="torch compute threads (default: all CPUs but one, which serves the NVMe I/O threads)")
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args(argv)
    if args.tokens < args.block_tokens:
        parser.error(f"--tokens: at least one block of --block-tokens {args.block_tokens}, got {args.tokens}")
    if args.q_heads is not None and args.q_heads % args.kv_heads:
        parser.error(f"--q-heads: a multiple of --kv-heads {args.kv_heads}, got {args.q_heads}")
    refuse_bad_outputs(parser, {"--json": args.json_out})
    check_disk(parser, args)
    return args


def check_disk(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses, before anything is written, a run whose NVMe store (every block of the
    sequence) would not fit the free space of the disk under ``--path`` (probe Q82-4: it
    wrote until the disk filled)."""
    layout = KVLayout(1, args.kv_heads, args.head_dim, "float16", args.block_tokens, per_layer=True, name="bench-decode")
    needed = -(-args.tokens // args.block_tokens) * layout.block_bytes
    folder = args.path or tempfile.gettempdir()
    free = shutil.disk_usage(folder).free
    if needed > free:
        parser.error(f"--tokens {args.tokens}: the NVMe store needs {needed / 2**30:.2f} GiB under {folder}, which has "
                     f"{free / 2**30:.2f} GiB free; lower --tokens, or give a --path on a larger disk")


def head_counts(kv_heads: int) -> list[int]:
    """The query-head counts calibration may use: ``kv_heads`` times 1, 2, 4, ... ``MAX_GROUP``
    (ascending; each a multiple of ``kv_heads``, as grouped attention needs)."""
    return [kv_heads << k for k in range(MAX_GROUP.bit_length()) if 1 << k <= MAX_GROUP]


def time_step(seq, kv: NeedleKV, heads: int, repeats: int) -> dict:
    """``step_timings`` of layer 0 for step 0's query with ``heads`` query heads."""
    q, _ = kv.query(0, heads)
    return step_timings(seq, 0, q, repeats=repeats)


def calibrate(seq, kv: NeedleKV, kv_heads: int) -> int:
    """The query-head count of ``head_counts`` whose I/O-to-compute ratio (medians of
    ``CALIBRATION_REPEATS``) is closest to 1, trying counts upward until compute dominates
    (more heads only add compute)."""
    best = None
    for heads in head_counts(kv_heads):
        ratio = time_step(seq, kv, heads, CALIBRATION_REPEATS)["io_compute_ratio"]
        distance = abs(math.log(ratio))
        if best is None or distance < best[1]:
            best = (heads, distance)
        if ratio <= 1.0:
            break
    return best[0]


def settle(seq, kv: NeedleKV, heads: int, repeats: int, kv_heads: int) -> tuple[int, dict]:
    """The step measured with ``heads`` query heads (medians of ``repeats``); while its ratio
    lies outside ``BALANCED_RATIO`` (``SETTLE_STEPS`` times at most), the heads move one
    step of ``head_counts`` towards it (up when I/O dominates) and the step is measured again.

    Returns:
        The last heads and their timing (``balanced`` says whether it reached the band).
    """
    counts = head_counts(kv_heads)
    timing = time_step(seq, kv, heads, repeats)
    for _ in range(SETTLE_STEPS):
        if timing["balanced"]:
            break
        index = counts.index(heads) + (1 if timing["io_compute_ratio"] > 1 else -1)
        if not 0 <= index < len(counts):
            break
        heads = counts[index]
        timing = time_step(seq, kv, heads, repeats)
    return heads, timing


def unbalanced_problem(timing: dict, heads: int, kv_heads: int) -> str:
    """What a calibrated run says (and exits 1 for) when its step ended outside ``BALANCED_RATIO``."""
    return (f"io/compute {timing['io_compute_ratio']:.2f} with {heads} query heads is not within 2x after calibrating "
            f"them (between {kv_heads} and {kv_heads * MAX_GROUP}): the overlap figure would not be the balanced one it "
            "stands for; give --q-heads to report it anyway")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    layout = KVLayout(1, args.kv_heads, args.head_dim, "float16", args.block_tokens, per_layer=True, name="bench-decode")
    blocks = args.tokens // args.block_tokens
    tiers = [TierConfig("hbm", 8), TierConfig("dram", 8), TierConfig("nvme", blocks + 64)]
    kv = NeedleKV(blocks * args.block_tokens, args.kv_heads, args.head_dim, args.block_tokens, 4, 0)
    folder = tempfile.mkdtemp(prefix="tiercache-bench-decode-", dir=args.path)
    try:
        try:
            check_cold_possible(folder)  # before a GiB of KV is written there
        except ColdReadError as error:
            print(f"error: --path {args.path or tempfile.gettempdir()}: {error}; no figures reported", file=sys.stderr)
            return 1
        with TieredKVCache(layout, tiers, prefetch="none", path=folder, window_blocks=args.window_blocks, depth=args.depth,
                           write_through=True) as cache:
            seq = cache.sequence()
            for a in range(0, kv.n_blocks * args.block_tokens, 1 << 16):
                seq.append(0, *kv.chunk(a, min(1 << 16, kv.n_blocks * args.block_tokens - a)))
            try:
                if args.q_heads is None:
                    heads, timing = settle(seq, kv, calibrate(seq, kv, args.kv_heads), args.repeats, args.kv_heads)
                else:
                    heads, timing = args.q_heads, time_step(seq, kv, args.q_heads, args.repeats)
            except ColdReadError as error:
                print(f"error: --path {args.path or tempfile.gettempdir()}: {error}; no figures reported", file=sys.stderr)
                return 1
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
               "q_heads_calibrated": args.q_heads is None,
               "output_rel_err": timing["output_rel_err"], "cpus": cpu_count(),
               "torch_threads": torch.get_num_threads()}
    for name in ("io_only", "compute_only", "pipelined"):
        print(f"{name:<14} {figures[name]:.4f} s  (median of {args.repeats})")
    print(f"{'io/compute':<14} {figures['io_compute_ratio']:.2f} ({balance_verdict(figures['io_compute_ratio'])})")
    print(f"{'overlap':<14} {figures['overlap_efficiency']:.3f}  (q_heads={heads}{', calibrated' if args.q_heads is None else ''}, {on_nvme:,} of {kv.n_blocks:,} blocks on NVMe)")
    problem = overlap_problem(timing)
    if problem is None and args.q_heads is None and not balanced:
        problem = unbalanced_problem(timing, heads, args.kv_heads)
    if problem:
        print(f"error: {problem}; no figures written", file=sys.stderr)
        return 1
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
