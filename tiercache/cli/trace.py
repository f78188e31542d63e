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
import os
import sys
from dataclasses import asdict
from typing import Callable

from ..config import KVLayout, layout_preset
from ..errors import UserError
from ..results import TraceKind
from ..sim import synth
from ..sim.kvtester import skipped_entries_warning
from ..sim.loader import Trace
from ..sim.oracle import export_trace, trace_layout
from ..sim.steptrace import write_steps
from ..sim.traces import MAX_LINE_BYTES, write_requests
from ..sim.tracestats import TraceStats, trace_stats
from .replay import Once, OnceFlag, _block_tokens as replay_block_tokens
from .tracefile import read_trace

__all__ = ["add_parser", "format_stats"]


def _format_pct(pct: dict[str, float] | None) -> str:
    return "  ".join(f"{k}={v:g}" for k, v in pct.items()) if pct else "-"


def _format_repeats(stats: TraceStats) -> str | None:
    """How many requests list a block id more than once, and where the first is (None: a step trace)."""
    if stats.repeat_requests is None:
        return None
    where = f" (first: {stats.first_repeat})" if stats.first_repeat else ""
    return f"{stats.repeat_requests:,}{where}"


def _format_misfits(stats: TraceStats) -> str | None:
    """How many requests list other than ceil(input_length / tokens per block) ids, the block
    size their lengths imply and where the first is (None: a step trace)."""
    if stats.block_mismatches is None:
        return None
    where = f" (first: {stats.first_block_mismatch})" if stats.first_block_mismatch else ""
    return f"{stats.block_mismatches}{where}"


def format_stats(stats: TraceStats) -> str:
    """Human-readable table of ``TraceStats``, one ``name: value`` per line.

    "blocks accessed once" and "accesses per block" are over the blocks accessed; a step
    trace's blocks written and never read have their own row.
    """
    unit = "requests" if stats.prefix_hit_ratio_inf is not None else "step records"
    rows = [
        ("kind", stats.kind.value),
        (unit, f"{stats.records:,}"),
        ("accesses", f"{stats.accesses:,}" + (f" reads ({stats.writes:,} writes besides: stored, not accessed)"
                                              if stats.prefix_hit_ratio_inf is None else "")),
        ("unique blocks", f"{stats.unique_blocks:,}"),
        ("blocks stored at the start", f"{stats.resident_blocks:,} (resident: count as written before the first record)"
         if stats.resident_blocks else None),
        ("blocks written, never read",
         None if stats.blocks_never_read is None else f"{stats.blocks_never_read:,} of {stats.unique_blocks:,}"),
        ("compulsory miss ratio", f"{stats.compulsory_miss_ratio:.5f}"),
        ("inf. prefix-cache hit ratio", None if stats.prefix_hit_ratio_inf is None else f"{stats.prefix_hit_ratio_inf:.5f}"),
        ("blocks accessed once", f"{stats.blocks_accessed_once:.3f}"),
        ("accesses per block", f"mean={stats.accesses_per_block_mean:.3f}  max={stats.accesses_per_block_max}"),
        ("reuse time (accesses)", _format_pct(stats.reuse_time_pct)),
        ("reuse distance (blocks)", None if stats.reuse_distance_pct is None else _format_pct(stats.reuse_distance_pct)),
        ("prefix-tree depth (blocks)", None if stats.tree_depth_pct is None else _format_pct(stats.tree_depth_pct)),
        ("prefix-tree roots", None if stats.tree_roots is None else f"{stats.tree_roots:,}"),
        ("requests repeating an id", _format_repeats(stats)),
        (f"blocks per {unit.split()[-1][:-1]}", _format_pct(stats.record_blocks_pct)),
        ("tokens per block", None if stats.block_tokens is None else str(stats.block_tokens)),
        ("requests misfitting blocks", _format_misfits(stats)),
        ("input tokens per request", None if stats.input_tokens_pct is None else _format_pct(stats.input_tokens_pct)),
        ("time span", stats.time_span),
    ]
    rows = [(name, value) for name, value in rows if value is not None]  # rows of the other trace kind
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# ----------------------------------------------------------------------------- commands


def _warn_skipped(trace: str) -> None:
    """Names on stderr the entries of a workload folder that are not read (as ``replay`` does)."""
    skipped = skipped_entries_warning(os.path.normpath(trace))
    if skipped:
        print(skipped, file=sys.stderr)


def _cmd_inspect(args: argparse.Namespace) -> int:
    stats = trace_stats(read_trace(args.trace, not args.no_trace_cache))
    _warn_skipped(args.trace)
    print(json.dumps(asdict(stats) | {"kind": stats.kind.value}, indent=2) if args.json else format_stats(stats))
    return 0


def _export_layout(args: argparse.Namespace, trace: Trace) -> KVLayout | None:
    """The KV layout that sizes exported records, or None (size 1 per block).

    The block is the one ``tiercache replay`` charges (``trace_layout``): a request trace's
    holds every layer, at its own block size (512 tokens for Mooncake, 16 for Bailian, a
    kv-cache-tester ``block_size``); a step trace's holds one layer (its ids are per-layer
    blocks, with or without ``--per-layer``), at its header's size or ``--block-tokens``.

    Raises:
        UserError: --block-tokens or --per-layer without --model, --block-tokens or
            --per-layer on a request trace, a headerless step trace without --block-tokens,
            or a --block-tokens that contradicts the header.
    """
    if args.model is None:
        if args.block_tokens is not None or args.per_layer:
            raise UserError("--block-tokens and --per-layer need --model (they size blocks of a model's KV layout)")
        return None
    if trace.kind is TraceKind.REQUESTS:
        if args.block_tokens is not None:
            raise UserError(f"--block-tokens: {trace.path} is a request trace, whose blocks are {trace.block_tokens} tokens")
        if args.per_layer:
            raise UserError(f"--per-layer: {trace.path} is a request trace, whose blocks hold every layer; "
                            "per-layer blocks apply to step traces with per-layer block ids")
    return trace_layout(trace, layout_preset(args.model, replay_block_tokens(args, trace)))


def _refuse_input_as_output(trace: str, output: str) -> None:
    """``-o`` must not name the input trace, nor a file inside an input folder (kv-cache-tester).

    Raises:
        UserError: it does.
    """
    source, target = os.path.realpath(trace), os.path.realpath(output)
    same = target == source or (os.path.exists(output) and os.path.exists(trace) and os.path.samefile(trace, output))
    if same:
        raise UserError(f"-o {output}: is the input trace; give another output file")
    if os.path.isdir(source) and target.startswith(source.rstrip(os.sep) + os.sep):
        raise UserError(f"-o {output}: is inside the input trace folder {trace}; give a file outside it")


def _cmd_export(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace, not args.no_trace_cache)  # a bad input is reported first
    _refuse_input_as_output(args.trace, args.output)
    _warn_skipped(args.trace)
    result = export_trace(trace, args.output, _export_layout(args, trace))
    blocks = f"{result.unique_blocks:,} unique blocks, size {result.obj_size} each"
    print(f"wrote {result.records:,} records ({blocks}) to {args.output}")
    return 0


#: The ``trace synth`` option of each spec field whose name differs from the option's.
_SYNTH_OPTIONS = {"prompt_blocks": "--blocks", "doc_blocks": "--blocks", "rate_per_s": "--rate"}


def _synth_option(field: str) -> str:
    """The ``trace synth`` option that sets spec field ``field``."""
    return _SYNTH_OPTIONS.get(field, "--" + field.replace("_", "-"))


def _synth_errors_name_options(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wraps a ``trace synth`` command so that a spec's error names the option, not the field."""
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except synth.SpecError as exc:
            raise UserError(f"{_synth_option(exc.field)}: {exc.reason}") from None
    run.__doc__ = command.__doc__
    return run


def _write_whole(output: str, write: Callable[[str], int]) -> int:
    """Runs ``write(output)``, whose writer replaces ``output`` whole (``write_jsonl``).

    Raises:
        UserError: ``output`` cannot be written (named), or the trace does not fit in memory.
    """
    try:
        return write(output)
    except MemoryError:
        raise UserError(f"{output}: the trace does not fit in memory; give smaller sizes") from None


def _check_record_size(ids: int, largest_id: int, options: str) -> None:
    """Refuses a trace whose ids pass int64 or whose longest line (``ids`` block ids, each at
    most ``largest_id``) could pass the readers' line limit, before anything is generated.

    Raises:
        UserError: either happens; ``options`` names the options that set the sizes.
    """
    if largest_id > (1 << 63) - 1:
        raise UserError(f"{options}: block ids would reach {largest_id:,}, past 2**63 - 1")
    line_bytes = ids * (len(str(largest_id)) + 2)  # digits, ", " per id: an upper bound
    if line_bytes > MAX_LINE_BYTES:
        raise UserError(f"{options}: one record would list {ids:,} block ids, a line of up to "
                        f"{line_bytes / (1 << 20):,.0f} MiB; trace readers refuse lines over {MAX_LINE_BYTES >> 20} MiB")


def _check_step_sizes(args: argparse.Namespace, spec: synth.ScanSpec | synth.SparseSpec, per_record: int) -> None:
    """``_check_record_size`` for a step trace whose records list at most ``per_record`` ids."""
    options = f"--blocks {args.blocks}, --steps {args.steps}, --block-tokens {args.block_tokens}, --layers {args.layers}"
    _check_record_size(per_record, (spec.most_blocks + 1) * spec.layers - 1, options)


def _refuse_no_reads(spec: synth.ScanSpec | synth.SparseSpec) -> None:
    """Refuses a step trace in which no step reads a block (readers refuse such a trace).

    Raises:
        UserError: no block fills before the last step and there is no prompt block.
    """
    if spec.most_blocks == 0:
        raise UserError(f"--blocks 0 with --steps {spec.steps} and --block-tokens {spec.block_tokens}: no block fills "
                        "before the last step, so no step reads a block; give --blocks >= 1 or more --steps")


def _refuse_no_sparse_reads(args: argparse.Namespace) -> None:
    """Refuses ``--k 0 --sink 0 --window 0`` before the spec is built (``SparseSpec`` refuses it
    too, naming its fields): a sparse step then reads nothing, so no step reads a block.

    Raises:
        UserError: naming the three options.
    """
    if args.k == 0 and args.sink == 0 and args.window == 0:
        raise UserError("--k 0 with --sink 0 and --window 0: a sparse step reads no block, so no step reads a block; "
                        "give --k, --sink or --window >= 1")


def _cmd_scan(args: argparse.Namespace) -> int:
    spec = synth.ScanSpec(args.steps, args.blocks, args.block_tokens, args.layers)
    _refuse_no_reads(spec)
    _check_step_sizes(args, spec, spec.most_blocks)  # the last step reads every full block
    count = _write_whole(args.output, lambda path: write_steps(path, synth.scan_trace(spec), spec.block_tokens))
    print(f"wrote {count:,} step records to {args.output}")
    return 0


def _cmd_sparse(args: argparse.Namespace) -> int:
    _refuse_no_sparse_reads(args)
    spec = synth.SparseSpec(
        args.steps, args.blocks, args.k, args.sink, args.window, args.locality, args.block_tokens, args.layers, args.seed
    )
    _refuse_no_reads(spec)
    if not spec.is_sparse:
        raise UserError(
            f"--k {spec.k} + --sink {spec.sink} + --window {spec.window} cover all {spec.most_blocks} blocks the sequence "
            f"ever holds (--blocks {spec.prompt_blocks} + one per --block-tokens {spec.block_tokens} steps): every step "
            "would read every block; give a smaller --k, --sink or --window, more --blocks, or use 'trace synth scan'")
    _check_step_sizes(args, spec, max(spec.prompt_blocks, spec.k + spec.sink + spec.window))
    count = _write_whole(args.output, lambda path: write_steps(path, synth.sparse_trace(spec), spec.block_tokens))
    print(f"wrote {count:,} step records to {args.output}")
    return 0


#: Arrivals per second above which most of ``synth docs``'s millisecond timestamps coincide.
MAX_DISTINCT_RATE = 1000


def _cmd_docs(args: argparse.Namespace) -> int:
    spec = synth.DocsSpec(
        args.docs, args.blocks, args.requests, args.system_blocks, args.question_blocks, args.zipf, args.rate, args.seed
    )
    per_request = spec.system_blocks + spec.doc_blocks + spec.question_blocks
    largest = spec.system_blocks + spec.docs * spec.doc_blocks + spec.requests * spec.question_blocks - 1
    options = (f"--docs {args.docs}, --blocks {args.blocks}, --requests {args.requests}, "
               f"--system-blocks {args.system_blocks}, --question-blocks {args.question_blocks}")
    _check_record_size(per_request, largest, options)  # also keeps input_length (512 per block) in int64
    count = _write_whole(args.output, lambda path: write_requests(path, synth.docs_trace(spec)))
    print(f"wrote {count:,} requests to {args.output}")
    if args.rate > MAX_DISTINCT_RATE:
        print(f"warning: --rate {args.rate:g}: Mooncake timestamps are whole milliseconds, so above "
              f"{MAX_DISTINCT_RATE:,} per second most arrivals share one (mean gap {1000 / args.rate:.3g} ms, rounded)",
              file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- parsers


def _add_step_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", required=True, action=Once, help="output step trace (JSONL)")
    parser.add_argument("--steps", type=int, default=256, help="decode steps (default 256)")
    parser.add_argument("--blocks", type=int, default=64, help="prompt blocks written at step 0 (default 64)")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per block: a block fills every N steps (default 16)")
    parser.add_argument("--layers", type=int, default=1, help="layers; >1 gives per-layer block ids b*layers+l (default 1)")


def _add_synth(subparsers: argparse._SubParsersAction) -> None:
    synth_parser = subparsers.add_parser("synth", help="write a seeded synthetic trace")
    kinds = synth_parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    scan = kinds.add_parser("scan", help="full-attention decode: every step reads every full block")
    _add_step_options(scan)
    scan.set_defaults(func=_synth_errors_name_options(_cmd_scan))
    sparse = kinds.add_parser("sparse", help="sparse top-k decode: sinks + recent window + k blocks with locality")
    _add_step_options(sparse)
    sparse.add_argument("--k", type=int, default=8, help="middle blocks read per step (default 8)")
    sparse.add_argument("--sink", type=int, default=1, help="leading blocks always read (default 1)")
    sparse.add_argument("--window", type=int, default=4, help="most recent full blocks always read (default 4)")
    sparse.add_argument(
        "--locality", type=float, default=0.9,
        help="probability a chosen middle block stays chosen next step; the others are replaced by blocks "
             "not chosen at that step (exact while the middle holds at least 2*k blocks; default 0.9)",
    )
    sparse.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    sparse.set_defaults(func=_synth_errors_name_options(_cmd_sparse))
    docs = kinds.add_parser("docs", help="Mooncake-format requests: many documents queried repeatedly")
    docs.add_argument("-o", "--output", required=True, action=Once, help="output request trace (Mooncake JSONL)")
    docs.add_argument("--docs", type=int, default=100, help="documents (default 100)")
    docs.add_argument("--blocks", type=int, default=32, help="512-token blocks per document (default 32)")
    docs.add_argument("--requests", type=int, default=1000, help="requests (default 1000)")
    docs.add_argument("--system-blocks", type=int, default=2, help="shared system-prompt blocks (default 2)")
    docs.add_argument("--question-blocks", type=int, default=1, help="unique question blocks per request (default 1)")
    docs.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of document popularity; 0 is uniform (default 1.0)")
    docs.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second, Poisson, rounded to whole milliseconds (default 1.0)")
    docs.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    docs.set_defaults(func=_synth_errors_name_options(_cmd_docs))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``tiercache trace`` and its subcommands on the top-level subparsers."""
    trace = subparsers.add_parser("trace", help="synthesize, inspect and export traces")
    actions = trace.add_subparsers(dest="action", metavar="ACTION", required=True)
    _add_synth(actions)
    inspect = actions.add_parser("inspect", help="summarize a Mooncake request trace or a step trace")
    inspect.add_argument("trace", help="trace file (JSONL; the kind is detected)")
    inspect.add_argument("--json", action="store_true", help="print the statistics as JSON")
    inspect.add_argument("--no-trace-cache", action=OnceFlag,
                         help="read the trace without the binary trace cache ($TIERCACHE_TRACE_CACHE)")
    inspect.set_defaults(func=_cmd_inspect)
    export = actions.add_parser("export", help="convert a trace for other simulators")
    export.add_argument("trace", help="trace file (JSONL; the kind is detected)")
    formats = ["oracleGeneral"]
    export.add_argument("--format", choices=formats, default=formats[0], help="output format (libCacheSim oracleGeneral)")
    export.add_argument("-o", "--output", required=True, action=Once, help="output file")
    export.add_argument("--model", help="model preset whose block bytes become the record size (default: size 1)")
    export.add_argument("--block-tokens", type=int,
                        help="tokens per block of a step trace without a block_tokens header (other traces name their own)")
    export.add_argument("--per-layer", action="store_true",
                        help="blocks hold one layer: what a step trace's blocks always are (its ids are per layer), "
                             "so it changes nothing there; refused on request traces, whose blocks hold every layer")
    export.add_argument("--no-trace-cache", action=OnceFlag,
                        help="read the trace without the binary trace cache ($TIERCACHE_TRACE_CACHE)")
    export.set_defaults(func=_cmd_export)
