"""Decode one very long sequence over HBM, DRAM and NVMe tiers, exact and sparse.

Builds a synthetic sequence of ``--tokens`` tokens (default 10,000,000) with a small layout
(1 layer, 2 KV heads, head dim 64, fp16: 512 B per token, 5 GB of KV at 10M tokens) under
explicit budgets (``--hbm 256MiB --dram 1GiB``, the rest on NVMe in a temporary folder under
``--path``, removed afterwards unless ``--keep``), then decodes ``--exact-steps`` steps in
exact mode and ``--steps`` steps in sparse mode (``--budget 0.02`` of the blocks).

The keys carry needles (``tiercache.bench.decode.NeedleKV``): a few blocks that the queries
aim at, each holding a share of that query's dense attention mass (``--mass`` aims at it;
the measured share is reported), so that sparse selection is tested for finding them.

It prints a table and writes (``--json OUT``): ``tokens`` (the prompt built: ``--tokens``
rounded down to whole blocks; ``tokens_requested`` is ``--tokens``), ``budget`` (as used: a
share, or a whole block count), ``exact_step_seconds`` and ``sparse_step_seconds`` (medians
of a decode step: append + attend of every layer), ``sparse_scoring_seconds`` (the median
time a sparse step spends scoring and selecting, every layer), ``exact_max_rel_err``
(against a float64 reference computed chunk by chunk from regenerated KV, on
the first ``--reference-steps`` exact steps, after everything else has run),
``sparse_needle_recall``, ``sparse_blocks_selected`` (the median blocks one sparse read of
one layer selects), ``rss_peak_bytes`` (the whole process's ``ru_maxrss`` when the decode
and the timings are done, before the float64 check starts; ``rss_peak_with_reference_bytes``
is the peak after it), ``page_cache_growth_bytes`` (the page cache held by the run's own
NVMe files, peak over checkpoints, by ``mincore``; ``system_page_cache_growth_bytes`` is the
machine-wide file page cache, ``Cached - Shmem`` of /proc/meminfo, peak minus start, which
other processes move too), ``bytes_read_per_step`` per tier and mode (the mean bytes one
decode step, every layer, found in each tier, and the bytes it prefetched), and
``overlap_efficiency`` (as in ``scripts/bench_decode.py``, measured on one exact read of
layer ``overlap_layer`` (0) of this run's sequence: the median of ``--timing-repeats``,
default 3, with ``io_compute_ratio`` and the same balanced / not balanced verdict; the query
heads are ``--q-heads``, not calibrated; a pipelined output that differs from the serial
one, or an efficiency impossible by construction, exits 1 with no JSON).

Quick check (most of the 512 MB of KV on NVMe, under a minute)::

    python scripts/long_context.py --tokens 1000000 --hbm 32MiB --dram 128MiB
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time

import numpy as np
import torch
from tqdm import tqdm

from tiercache import AttentionMode, TieredKVCache
from tiercache.bench.decode import (NeedleKV, StepCheckError, balance_verdict, cached_bytes_of, cpu_count, median,
                                    overlap_problem, page_cache_bytes, reference_attention, rss_peak_bytes, step_timings)
from tiercache.bench.rounds import positive_int
from tiercache.bench.script_args import (
    ScriptParser, existing_folder, non_negative_int, open_share, refuse_bad_outputs, seed_int,
)
from tiercache.config import KVLayout, TierConfig, parse_capacity
from tiercache.core.interrupts import raise_on_sigterm
from tiercache.errors import UserError
from tiercache.live.media import check_host_memory, resolve_device
from tiercache.live.arguments import sparse_budget_blocks
from tiercache.policies import get_prefetch
from tiercache.results.outfile import replace_file

#: The range ``TieredKVCache`` takes ``speculate`` in (a share of the sparse budget).
MAX_SPECULATE = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, every one checked before any work: a bad one (the output file included)
    ends in one line naming it (exit 2), never a traceback or a failure after the run."""
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=10_000_000, help="prompt tokens (rounded down to whole blocks)")
    parser.add_argument("--hbm", default="256MiB", help="HBM tier budget (bytes or blocks)")
    parser.add_argument("--dram", default="1GiB", help="DRAM tier budget (bytes or blocks)")
    parser.add_argument("--path", type=existing_folder, default=None,
                        help="folder for the NVMe tier's temporary store (default: the system temp)")
    parser.add_argument("--keep", action="store_true", help="keep the NVMe store folder")
    parser.add_argument("--block-tokens", type=positive_int, default=256)
    parser.add_argument("--layers", type=positive_int, default=1)
    parser.add_argument("--kv-heads", type=positive_int, default=2)
    parser.add_argument("--head-dim", type=positive_int, default=64)
    parser.add_argument("--q-heads", type=positive_int, default=8, help="query heads (a multiple of --kv-heads: GQA)")
    parser.add_argument("--budget", type=float, default=0.02,
                        help="sparse budget: a share of the blocks (<= 1), or a whole block count (> 1)")
    parser.add_argument("--steps", type=positive_int, default=32, help="sparse decode steps (at least 1)")
    parser.add_argument("--exact-steps", type=positive_int, default=3, help="exact decode steps (at least 1)")
    parser.add_argument("--reference-steps", type=non_negative_int, default=None,
                        help="the first exact steps checked against float64, at most --exact-steps (0: none; "
                             "default: 2, or --exact-steps if fewer)")
    parser.add_argument("--needles", type=positive_int, default=8)
    parser.add_argument("--mass", type=open_share, default=0.2,
                        help="attention share a needle block aims at, strictly between 0 and 1")
    parser.add_argument("--chunk-tokens", type=positive_int, default=65536, help="tokens per append while building")
    parser.add_argument("--prefetch", default="topk_speculative")
    parser.add_argument("--exclusive", dest="write_through", action="store_false",
                        help="exclusive hierarchy (default: write-through, so reads never write back)")
    parser.add_argument("--speculate", type=float, default=0.5,
                        help=f"prefetch candidates as a share of the budget, 0 to {MAX_SPECULATE}")
    parser.add_argument("--window-blocks", type=positive_int, default=64)
    parser.add_argument("--depth", type=positive_int, default=3)
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--timing-repeats", type=int, default=3,
                        help="repeats of the three-way overlap timing; medians are reported (default 3)")
    parser.add_argument("--threads", type=positive_int, default=cpu_count(),
                        help="torch compute threads (default: every CPU; bench_decode.py leaves one to the I/O threads)")
    parser.add_argument("--json", dest="json_out", help="write the figures here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks across options and of values argparse's types do not see; each failure is
    ``parser.error`` naming the option (one line, exit 2), before any work."""
    if args.tokens < 3 * args.block_tokens:
        parser.error(f"--tokens: at least three blocks of --block-tokens {args.block_tokens} (the needles lie between "
                     f"the first and the last block), got {args.tokens}")
    if args.q_heads % args.kv_heads:
        parser.error("--q-heads must be a multiple of --kv-heads")
    if args.timing_repeats < 1:
        parser.error(f"--timing-repeats: at least 1, got {args.timing_repeats}")
    if not (0 < args.budget <= 1 or (args.budget > 1 and args.budget.is_integer())):
        parser.error(f"--budget: a share of the blocks in (0, 1] or a whole number of blocks above 1, got {args.budget:g}")
    if not 0 <= args.speculate <= MAX_SPECULATE:  # nan fails both comparisons
        parser.error(f"--speculate: a share of the budget from 0 to {MAX_SPECULATE}, got {args.speculate:g}")
    try:
        get_prefetch(args.prefetch)
    except UserError as exc:
        parser.error(f"--prefetch: {exc}")
    if args.reference_steps is None:
        args.reference_steps = min(2, args.exact_steps)
    elif args.reference_steps > args.exact_steps:
        parser.error(f"--reference-steps {args.reference_steps}: at most --exact-steps ({args.exact_steps}), the steps "
                     "there are to check")
    try:
        tiers = tiers_for(args, layout_of(args))  # --hbm and --dram: blocks or sizes of this layout, >= 1
    except UserError as exc:
        parser.error(str(exc))
    try:
        check_host_memory(layout_of(args), tiers, resolve_device(None))
    except UserError as exc:
        parser.error(f"--hbm {args.hbm} / --dram {args.dram}: {exc}")
    check_disk(parser, args, tiers)
    refuse_bad_outputs(parser, {"--json": args.json_out})


def check_disk(parser: argparse.ArgumentParser, args: argparse.Namespace, tiers: list[TierConfig]) -> None:
    """Refuses, before any work, a run whose NVMe tier would not fit the free space of the
    disk it lies on (every block under write-through, the default; with --exclusive those HBM
    and DRAM do not hold)."""
    layout = layout_of(args)
    per_layer = blocks_per_layer(args)
    below = 0 if args.write_through else sum(t.capacity_blocks for t in tiers if t.name in ("hbm", "dram"))
    needed = max(0, per_layer * args.layers - below) * layout.block_bytes
    folder = args.path or tempfile.gettempdir()
    free = shutil.disk_usage(folder).free
    if needed > free:
        remedies = "lower --tokens or --layers, or give a --path on a larger disk"
        if args.write_through:
            remedies += ", or --exclusive (NVMe then holds only what HBM and DRAM do not)"
        parser.error(f"--tokens {args.tokens}: the NVMe tier needs {needed / 2**30:.2f} GiB under {folder}, which has "
                     f"{free / 2**30:.2f} GiB free; {remedies}")


def blocks_per_layer(args: argparse.Namespace) -> int:
    """Blocks per layer the run stores: the prompt's, the decode steps' and one partial each."""
    return prompt_tokens(args) // args.block_tokens + 1 + (args.steps + args.exact_steps) // args.block_tokens + 1


def prompt_tokens(args: argparse.Namespace) -> int:
    """The prompt the run builds: ``--tokens`` rounded down to whole blocks."""
    return args.tokens // args.block_tokens * args.block_tokens


def layout_of(args: argparse.Namespace) -> KVLayout:
    """The run's layout: per-layer fp16 blocks of ``--block-tokens`` tokens."""
    return KVLayout(args.layers, args.kv_heads, args.head_dim, "float16", args.block_tokens, per_layer=True,
                    name="long-context")


def tiers_for(args: argparse.Namespace, layout: KVLayout) -> list[TierConfig]:
    """HBM and DRAM as budgeted; NVMe sized for the rest of the sequence plus slack."""
    hbm = parse_capacity(args.hbm, layout, "--hbm")
    dram = parse_capacity(args.dram, layout, "--dram")
    blocks = blocks_per_layer(args) * args.layers
    below = 0 if args.write_through else hbm + dram  # write-through: NVMe holds a copy of every block
    nvme = max(64, blocks - below + max(64, blocks // 50))
    return [TierConfig("hbm", hbm), TierConfig("dram", dram), TierConfig("nvme", nvme)]


def build(seq, kvs: list[NeedleKV], args, progress: bool) -> float:
    """Appends the prompt layer by layer in chunks; returns the seconds it took."""
    prompt = kvs[0].n_blocks * args.block_tokens
    chunk = max(args.block_tokens, args.chunk_tokens // args.block_tokens * args.block_tokens)
    started = time.perf_counter()
    with tqdm(total=prompt, unit="tok", unit_scale=True, desc="build", disable=not progress) as bar:
        for a in range(0, prompt, chunk):
            n = min(chunk, prompt - a)
            for layer, kv in enumerate(kvs):
                k, v = kv.chunk(a, n)
                seq.append(layer, k, v)
            bar.update(n)
    return time.perf_counter() - started


def decode(seq, kvs: list[NeedleKV], args, mode: AttentionMode, steps: int, first_step: int, progress: bool,
           results: dict) -> None:
    """Runs ``steps`` decode steps; fills ``results`` with times and recalls, and keeps the
    first ``--reference-steps`` exact outputs in ``results["checks"]`` for ``check_exact``
    (run later, so that its float64 work does not count in the cache's figures)."""
    budget = sparse_budget(args) if mode is AttentionMode.SPARSE else None
    for step in tqdm(range(first_step, first_step + steps), desc=mode.value, disable=not progress):
        started = time.perf_counter()
        outs = []
        for layer, kv in enumerate(kvs):
            k, v = kv.decode_kv(step)
            seq.append(layer, k, v)
            q, target = kv.query(step, args.q_heads)
            outs.append((layer, q, target, seq.attend(layer, q, mode, budget)))
            if mode is AttentionMode.SPARSE:
                needle = kv.needle_blocks[target]
                results["recall"].append(bool(np.isin(needle, seq.last_positions)))
        results["seconds"].append(time.perf_counter() - started)
        results["reports"].extend(seq.reports[-len(kvs):])
        if mode is AttentionMode.EXACT and step - first_step < args.reference_steps:
            results["checks"].extend((step, layer, q, target, out.double().cpu()) for layer, q, target, out in outs)


def check_exact(kvs: list[NeedleKV], results: dict) -> None:
    """Compares every kept exact output with the float64 reference over the KV regenerated
    from its seed; fills ``results["errors"]`` (relative) and ``results["needle_mass"]``."""
    for step, layer, q, target, out in results["checks"]:
        kv = kvs[layer]
        tail = [kv.decode_kv(s) for s in range(step + 1)]
        ref, share = reference_attention(kv, q, torch.cat([t[0] for t in tail], 1), torch.cat([t[1] for t in tail], 1),
                                         needle_block=kv.needle_blocks[target])
        results["errors"].append(float((out - ref).norm() / ref.norm()))
        results["needle_mass"].append(share)


def sparse_budget(args: argparse.Namespace) -> float | int:
    """``--budget`` as ``attend`` takes it: a share (float <= 1) or a block count (int; a
    whole number, as ``parse_args`` checks)."""
    return args.budget if args.budget <= 1 else int(args.budget)


def per_tier_bytes(reports, block_bytes: int, steps: int) -> dict:
    """Mean bytes each tier served per decode step (the reads of every layer of the step;
    ``reports`` holds every attend of ``steps`` steps), and the bytes prefetched per step."""
    if not steps:
        return {}
    return {"hbm": sum(r.hbm_hits for r in reports) * block_bytes / steps,
            "dram": sum(r.from_dram for r in reports) * block_bytes / steps,
            "nvme": sum(r.from_nvme for r in reports) * block_bytes / steps,
            "prefetched": sum(r.prefetched for r in reports) * block_bytes / steps}


def sparse_scoring_seconds(seq, kvs: list[NeedleKV], args) -> float:
    """Median time a sparse step spends scoring every block's summary and selecting, over
    every layer (the sequence's own selection, no fetch), over 5 queries."""
    times = []
    for step in range(5):
        queries = [kv.query(step, args.q_heads)[0] for kv in kvs]
        started = time.perf_counter()
        for state, q in zip(seq._layers, queries):
            seq._select(state, q, sparse_budget_blocks(sparse_budget(args), state.n))
        times.append(time.perf_counter() - started)
    return median(times)


def run(args: argparse.Namespace) -> dict:
    progress = not args.no_progress
    torch.set_num_threads(args.threads)
    layout = layout_of(args)
    tiers = tiers_for(args, layout)
    kvs = [NeedleKV(prompt_tokens(args), args.kv_heads, args.head_dim, args.block_tokens, args.needles,
                    args.seed + 1000 * layer, args.mass) for layer in range(args.layers)]
    folder = tempfile.mkdtemp(prefix="tiercache-long-", dir=args.path)
    cached_start = page_cache_bytes()
    cached_peak = cached_start
    ours_peak = 0

    def checkpoint() -> None:
        nonlocal cached_peak, ours_peak
        cached_peak = max(cached_peak, page_cache_bytes())
        ours_peak = max(ours_peak, cached_bytes_of(folder))

    try:
        cache = TieredKVCache(layout, tiers, prefetch=args.prefetch, path=folder, window_blocks=args.window_blocks,
                              depth=args.depth, write_through=args.write_through, speculate=args.speculate)
        with cache:
            seq = cache.sequence()
            build_seconds = build(seq, kvs, args, progress)
            checkpoint()
            exact = {"seconds": [], "errors": [], "needle_mass": [], "reports": [], "recall": [], "checks": []}
            decode(seq, kvs, args, AttentionMode.EXACT, args.exact_steps, 0, progress, exact)
            checkpoint()
            sparse = {"seconds": [], "errors": [], "needle_mass": [], "reports": [], "recall": [], "checks": []}
            decode(seq, kvs, args, AttentionMode.SPARSE, args.steps, args.exact_steps, progress, sparse)
            checkpoint()
            q, _ = kvs[0].query(0, args.q_heads)
            timings = step_timings(seq, 0, q, repeats=args.timing_repeats)
            scoring = sparse_scoring_seconds(seq, kvs, args)
            checkpoint()
            stats = cache.stats()
            blocks = seq.blocks(0)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    rss_peak = rss_peak_bytes()  # before the float64 check: its regenerated KV is no part of the cache's footprint
    check_exact(kvs, exact)
    sparse_reports = sparse["reports"]
    return {
        "tokens": prompt_tokens(args),
        "tokens_requested": args.tokens,
        "blocks_per_layer": blocks,
        "layout": {"layers": args.layers, "kv_heads": args.kv_heads, "q_heads": args.q_heads, "head_dim": args.head_dim,
                   "dtype": "float16", "block_tokens": args.block_tokens, "block_bytes": layout.block_bytes},
        "tiers": {t.name: t.capacity_blocks for t in tiers},
        "kv_bytes": blocks * args.layers * layout.block_bytes,
        "budget": sparse_budget(args),
        "prefetch": args.prefetch,
        "speculate": args.speculate,
        "write_through": args.write_through,
        "build_seconds": build_seconds,
        "exact_step_seconds": median(exact["seconds"]),
        "sparse_step_seconds": median(sparse["seconds"]),
        "sparse_step_seconds_all": sparse["seconds"],
        "sparse_scoring_seconds": scoring,
        "exact_max_rel_err": max(exact["errors"]) if exact["errors"] else None,
        "needle_mass_measured": exact["needle_mass"],
        "needle_mass_target": args.mass,
        "sparse_needle_recall": float(np.mean(sparse["recall"])) if sparse["recall"] else None,
        "sparse_blocks_selected": median([r.selected for r in sparse_reports]) if sparse_reports else None,
        "sparse_hbm_hit_share": (sum(r.hbm_hits for r in sparse_reports) / max(1, sum(r.selected for r in sparse_reports))),
        "sparse_prefetched_blocks": sum(r.prefetched for r in sparse_reports),
        "rss_peak_bytes": rss_peak,
        "rss_peak_with_reference_bytes": rss_peak_bytes(),
        "dram_budget_bytes": tiers[1].capacity_blocks * layout.block_bytes,
        "page_cache_growth_bytes": ours_peak,
        "system_page_cache_growth_bytes": max(0, cached_peak - cached_start),
        "bytes_read_per_step": {"exact": per_tier_bytes(exact["reports"], layout.block_bytes, len(exact["seconds"])),
                                "sparse": per_tier_bytes(sparse_reports, layout.block_bytes, len(sparse["seconds"]))},
        "overlap_layer": 0,
        "overlap_efficiency": timings["overlap_efficiency"],
        "io_compute_ratio": timings["io_compute_ratio"],
        "timing_repeats": args.timing_repeats,
        "overlap_timings": timings,
        "tier_hits": {t["name"]: t["hits"] for t in stats["tiers"]},
        "torch_threads": torch.get_num_threads(),
    }


def tokens_text(figures: dict) -> str:
    """The tokens row: the prompt built, and the request when rounding changed it."""
    built, asked = figures["tokens"], figures["tokens_requested"]
    if built == asked:
        return f"{built:,}"
    return f"{built:,} (--tokens {asked:,} rounded down to whole blocks of {figures['layout']['block_tokens']})"


def print_table(figures: dict) -> None:
    rows = [
        ("tokens", tokens_text(figures)),
        ("KV bytes", f"{figures['kv_bytes'] / 2**30:.2f} GiB in {figures['blocks_per_layer']:,} blocks/layer"),
        ("tiers (blocks)", ", ".join(f"{k}={v:,}" for k, v in figures["tiers"].items())),
        ("build", f"{figures['build_seconds']:.1f} s"),
        ("exact step (median)", f"{figures['exact_step_seconds']:.3f} s"),
        ("sparse step (median)", f"{figures['sparse_step_seconds']:.4f} s  (scoring {figures['sparse_scoring_seconds']:.4f} s)"),
        ("exact max rel err", f"{figures['exact_max_rel_err']:.2e}" if figures["exact_max_rel_err"] is not None else "-"),
        ("needle mass (target)", f"{figures['needle_mass_target']}  measured "
                                 + ", ".join(f"{m:.3f}" for m in figures["needle_mass_measured"] if m is not None)),
        ("sparse needle recall", f"{figures['sparse_needle_recall']:.3f}"),
        ("sparse HBM hit share", f"{figures['sparse_hbm_hit_share']:.3f}"),
        ("overlap efficiency", f"{figures['overlap_efficiency']:.3f}  (median of {figures['timing_repeats']}, "
                               f"layer {figures['overlap_layer']}'s read, q_heads={figures['layout']['q_heads']})"),
        ("io/compute", f"{figures['io_compute_ratio']:.2f} ({balance_verdict(figures['io_compute_ratio'])})"),
        ("peak RSS, process", f"{figures['rss_peak_bytes'] / 2**30:.2f} GiB before the float64 check "
                              f"(DRAM budget {figures['dram_budget_bytes'] / 2**30:.2f} GiB; with the check "
                              f"{figures['rss_peak_with_reference_bytes'] / 2**30:.2f} GiB)"),
        ("page cache growth", f"{figures['page_cache_growth_bytes'] / 2**20:.0f} MiB of our files "
                              f"(machine-wide {figures['system_page_cache_growth_bytes'] / 2**20:.0f} MiB)"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for mode, per in figures["bytes_read_per_step"].items():
        print(f"{mode + ' bytes/step':<{width}}  " + ", ".join(f"{k}={v / 2**20:.1f} MiB" for k, v in per.items()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = raise_on_sigterm()  # SIGTERM ends the run as Ctrl-C does: run's finally removes the NVMe folder (exit 143)
    try:
        return _report(args)
    finally:
        if previous is not None:  # a caller that imported main keeps its own disposition
            signal.signal(signal.SIGTERM, previous)


def _report(args: argparse.Namespace) -> int:
    """Runs the measurement and prints (and writes) its figures; the exit status."""
    try:
        figures = run(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StepCheckError as exc:
        print(f"error: {exc}; no figures reported", file=sys.stderr)
        return 1
    print_table(figures)
    problem = overlap_problem(figures["overlap_timings"])
    if problem:
        print(f"error: {problem}; no figures written", file=sys.stderr)
        return 1
    if args.json_out:
        try:  # checked before the run; a disk that fills now leaves an earlier file as it was
            replace_file(args.json_out, json.dumps(figures, indent=2), f"--json {args.json_out}")
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
