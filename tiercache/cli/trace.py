"""``tiercache trace``: synthesize, inspect and export traces.

Subcommands::

    tiercache trace synth scan   -o OUT [--steps N --blocks N --block-tokens N --layers N]
    tiercache trace synth sparse -o OUT [... --k N --sink N --window N --locality P --seed N]
    tiercache trace synth docs   -o OUT [--docs N --blocks N --requests N --zipf A --seed N ...]
    tiercache trace inspect TRACE [--json]
    tiercache trace export TRACE --format oracleGeneral -o OUT [--model NAME --block-tokens N --per-layer]

Bad input raises ``UserError``/``TraceError``, which the dispatcher prints as one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

from ..config import KVLayout, layout_preset
from ..errors import UserError
from ..sim import synth
from ..sim.oracle import export_oracle_general
from ..sim.steptrace import write_steps
from ..sim.traces import write_requests
from ..sim.tracestats import TraceStats, trace_stats

__all__ = ["add_parser", "format_stats"]


def _format_pct(pct: dict[str, float] | None) -> str:
    return "  ".join(f"{k}={v:g}" for k, v in pct.items()) if pct else "-"


def format_stats(stats: TraceStats) -> str:
    """Human-readable table of ``TraceStats``, one ``name: value`` per line."""
    unit = "requests" if stats.prefix_hit_ratio_inf is not None else "step records"
    rows = [
        ("kind", stats.kind.value),
        (unit, f"{stats.records:,}"),
        ("accesses", f"{stats.accesses:,}" + (f" ({stats.writes:,} writes)" if stats.writes else "")),
        ("unique blocks", f"{stats.unique_blocks:,}"),
        ("compulsory miss ratio", f"{stats.compulsory_miss_ratio:.5f}"),
        ("inf. prefix-cache hit ratio", None if stats.prefix_hit_ratio_inf is None else f"{stats.prefix_hit_ratio_inf:.5f}"),
        ("blocks accessed once", f"{stats.blocks_accessed_once:.3f}"),
        ("accesses per block", f"mean={stats.accesses_per_block_mean:.3f}  max={stats.accesses_per_block_max}"),
        ("reuse time (accesses)", _format_pct(stats.reuse_time_pct)),
        ("reuse distance (blocks)", None if stats.reuse_distance_pct is None else _format_pct(stats.reuse_distance_pct)),
        ("prefix-tree depth (blocks)", None if stats.tree_depth_pct is None else _format_pct(stats.tree_depth_pct)),
        ("prefix-tree roots", None if stats.tree_roots is None else f"{stats.tree_roots:,}"),
        (f"blocks per {unit.split()[-1][:-1]}", _format_pct(stats.record_blocks_pct)),
        ("tokens per block", None if stats.block_tokens is None else str(stats.block_tokens)),
        ("input tokens per request", None if stats.input_tokens_pct is None else _format_pct(stats.input_tokens_pct)),
        ("time span", stats.time_span),
    ]
    rows = [(name, value) for name, value in rows if value is not None]  # rows of the other trace kind
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# ----------------------------------------------------------------------------- commands


def _cmd_inspect(args: argparse.Namespace) -> int:
    stats = trace_stats(args.trace)
    print(json.dumps(asdict(stats) | {"kind": stats.kind.value}, indent=2) if args.json else format_stats(stats))
    return 0


def _export_layout(args: argparse.Namespace) -> KVLayout | None:
    """The KV layout that sizes exported records, or None (size 1 per block)."""
    if args.model is None:
        if args.block_tokens is not None or args.per_layer:
            raise UserError("--block-tokens and --per-layer need --model (they size blocks of a model's KV layout)")
        return None
    layout = layout_preset(args.model, args.block_tokens)
    return replace(layout, per_layer=True) if args.per_layer else layout


def _cmd_export(args: argparse.Namespace) -> int:
    result = export_oracle_general(args.trace, args.output, _export_layout(args))
    blocks = f"{result.unique_blocks:,} unique blocks, size {result.obj_size} each"
    print(f"wrote {result.records:,} records ({blocks}) to {args.output}")
    return 0


def _cmd_scan(args: argparse.Namespace) -> int:
    spec = synth.ScanSpec(args.steps, args.blocks, args.block_tokens, args.layers)
    count = write_steps(args.output, synth.scan_trace(spec), spec.block_tokens)
    print(f"wrote {count:,} step records to {args.output}")
    return 0


def _cmd_sparse(args: argparse.Namespace) -> int:
    spec = synth.SparseSpec(
        args.steps, args.blocks, args.k, args.sink, args.window, args.locality, args.block_tokens, args.layers, args.seed
    )
    if not spec.is_sparse:
        raise UserError(
            f"--k {spec.k} + --sink {spec.sink} + --window {spec.window} cover all {spec.most_blocks} blocks the sequence "
            f"ever holds (--blocks {spec.prompt_blocks} + one per --block-tokens {spec.block_tokens} steps): every step "
            "would read every block; give a smaller --k, or use 'trace synth scan'")
    count = write_steps(args.output, synth.sparse_trace(spec), spec.block_tokens)
    print(f"wrote {count:,} step records to {args.output}")
    return 0


def _cmd_docs(args: argparse.Namespace) -> int:
    spec = synth.DocsSpec(
        args.docs, args.blocks, args.requests, args.system_blocks, args.question_blocks, args.zipf, args.rate, args.seed
    )
    count = write_requests(args.output, synth.docs_trace(spec))
    print(f"wrote {count:,} requests to {args.output}")
    return 0


# ----------------------------------------------------------------------------- parsers


def _add_step_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", required=True, help="output step trace (JSONL)")
    parser.add_argument("--steps", type=int, default=256, help="decode steps (default 256)")
    parser.add_argument("--blocks", type=int, default=64, help="prompt blocks written at step 0 (default 64)")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per block: a block fills every N steps (default 16)")
    parser.add_argument("--layers", type=int, default=1, help="layers; >1 gives per-layer block ids b*layers+l (default 1)")


def _add_synth(subparsers: argparse._SubParsersAction) -> None:
    synth_parser = subparsers.add_parser("synth", help="write a seeded synthetic trace")
    kinds = synth_parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    scan = kinds.add_parser("scan", help="full-attention decode: every step reads every full block")
    _add_step_options(scan)
    scan.set_defaults(func=_cmd_scan)
    sparse = kinds.add_parser("sparse", help="sparse top-k decode: sinks + recent window + k blocks with locality")
    _add_step_options(sparse)
    sparse.add_argument("--k", type=int, default=8, help="middle blocks read per step (default 8)")
    sparse.add_argument("--sink", type=int, default=1, help="leading blocks always read (default 1)")
    sparse.add_argument("--window", type=int, default=4, help="most recent full blocks always read (default 4)")
    sparse.add_argument(
        "--locality", type=float, default=0.9, help="probability a chosen block stays chosen next step (default 0.9)"
    )
    sparse.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    sparse.set_defaults(func=_cmd_sparse)
    docs = kinds.add_parser("docs", help="Mooncake-format requests: many documents queried repeatedly")
    docs.add_argument("-o", "--output", required=True, help="output request trace (Mooncake JSONL)")
    docs.add_argument("--docs", type=int, default=100, help="documents (default 100)")
    docs.add_argument("--blocks", type=int, default=32, help="512-token blocks per document (default 32)")
    docs.add_argument("--requests", type=int, default=1000, help="requests (default 1000)")
    docs.add_argument("--system-blocks", type=int, default=2, help="shared system-prompt blocks (default 2)")
    docs.add_argument("--question-blocks", type=int, default=1, help="unique question blocks per request (default 1)")
    docs.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of document popularity; 0 is uniform (default 1.0)")
    docs.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second, Poisson (default 1.0)")
    docs.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    docs.set_defaults(func=_cmd_docs)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``tiercache trace`` and its subcommands on the top-level subparsers."""
    trace = subparsers.add_parser("trace", help="synthesize, inspect and export traces")
    actions = trace.add_subparsers(dest="action", metavar="ACTION", required=True)
    _add_synth(actions)
    inspect = actions.add_parser("inspect", help="summarize a Mooncake request trace or a step trace")
    inspect.add_argument("trace", help="trace file (JSONL; the kind is detected)")
    inspect.add_argument("--json", action="store_true", help="print the statistics as JSON")
    inspect.set_defaults(func=_cmd_inspect)
    export = actions.add_parser("export", help="convert a trace for other simulators")
    export.add_argument("trace", help="trace file (JSONL; the kind is detected)")
    formats = ["oracleGeneral"]
    export.add_argument("--format", choices=formats, default=formats[0], help="output format (libCacheSim oracleGeneral)")
    export.add_argument("-o", "--output", required=True, help="output file")
    export.add_argument("--model", help="model preset whose block bytes become the record size (default: size 1)")
    export.add_argument("--block-tokens", type=int, help="tokens per block of step traces without a block_tokens header (request traces always use 512)")
    export.add_argument("--per-layer", action="store_true", help="blocks hold one layer (step traces with per-layer ids)")
    export.set_defaults(func=_cmd_export)
