"""``tiercache replay``: replay a trace through the manager and print/save per-policy results.

The options are parsed here, once, into a typed ``SweepSpec`` (``spec_from_args``); the
sweep itself is ``tiercache.sim.sweep.sweep``. ``tiercache compare`` shares the options.
"""

from __future__ import annotations

import argparse
import os
import shlex

from ..config import CacheConfig, KVLayout, layout_preset, parse_capacity, parse_layout, parse_tiers
from ..errors import UserError
from ..results import ResultsDocument, Semantics, TraceKind, write_results
from ..sim.hardware import HardwareProfile, load_profile
from ..sim.loader import Trace, load_trace
from ..sim.sweep import SweepSpec, check_policy_names, sweep
from ..sim.traces import MOONCAKE_BLOCK_TOKENS

__all__ = ["add_parser", "add_common_options", "sweep_from_args", "spec_from_args", "format_table", "DEFAULT_CAPACITY"]

#: ``--capacity`` when neither it nor ``--tiers`` is given.
DEFAULT_CAPACITY = "4000"


def parse_list(text: str, option: str) -> list[str]:
    """Splits a comma list, rejecting an empty one."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise UserError(f"{option}: empty list")
    return items


def capacity_text(args: argparse.Namespace) -> str | None:
    """The ``--capacity`` list in effect: the option, the default without ``--tiers``, or None.

    Raises:
        UserError: both ``--capacity`` and ``--tiers`` were given.
    """
    if args.tiers:
        if args.capacity is not None:
            raise UserError("--capacity and --tiers are exclusive; give one")
        return None
    return DEFAULT_CAPACITY if args.capacity is None else args.capacity


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``replay`` and ``compare`` (the sweep definition)."""
    parser.add_argument("trace", help="Mooncake request trace (JSONL) or decode step trace")
    parser.add_argument("--policy", default="lru", help="comma list of eviction policies (default: lru)")
    parser.add_argument("--capacity", help=f"comma list of single-tier capacities in blocks (default: {DEFAULT_CAPACITY})")
    parser.add_argument("--tiers", help="run a hierarchy instead, e.g. hbm=4096,dram=16384,nvme=65536 "
                                        "(sizes need --model or --layout; exclusive with --capacity)")
    parser.add_argument("--semantics", default="object", help="object, prefix, or both as a comma list (default: object); "
                                                              "step traces always replay as decode")
    parser.add_argument("--admission", default="always", help="admission policy of the lower tiers (default: always)")
    parser.add_argument("--write-through", action="store_true", help="inclusive hierarchy (default: exclusive)")
    parser.add_argument("--model", help="model preset turning blocks into bytes, e.g. llama-3-8b")
    parser.add_argument("--layout", help="custom KV layout instead of --model, "
                                         "e.g. layers=32,kv_heads=8,head_dim=128,dtype=bfloat16")
    parser.add_argument("--hardware", help="hardware preset or profile JSON for modeled seconds, e.g. h200-pcie5-nvme4")
    parser.add_argument("--workers", type=int, default=0, help="worker processes (default: one per core)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``tiercache replay``."""
    parser = subparsers.add_parser("replay", help="replay a trace through the tier manager", description=__doc__)
    add_common_options(parser)
    parser.add_argument("--out", help="write results JSON here")
    parser.set_defaults(func=run)


def spec_from_args(args: argparse.Namespace) -> tuple[Trace, SweepSpec]:
    """The trace and the sweep the options describe.

    Options that need no trace are checked first, so a typo fails before a long trace is
    read; the layout and tier sizes follow the trace (a request block is 512 tokens).

    Raises:
        UserError: a bad option (named) or a malformed trace (file and line named).
    """
    policies = tuple(parse_list(args.policy, "--policy"))
    check_policy_names(policies, args.admission)
    semantics = tuple(Semantics.parse(s) for s in parse_list(args.semantics, "--semantics"))
    capacities = _capacities(capacity_text(args))
    hardware = _hardware(args)
    trace = load_trace(args.trace)
    layout = _layout(args, trace.kind)
    cache = CacheConfig(parse_tiers(args.tiers, layout), args.write_through) if args.tiers else None
    return trace, SweepSpec(policies, semantics, capacities, cache, args.admission, layout, hardware)


def _capacities(text: str | None) -> tuple[int, ...]:
    """``"1000,4k,16000"`` -> block counts (each positive); None (``--tiers`` given) -> ()."""
    if text is None:
        return ()
    return tuple(parse_capacity(item, None, f"--capacity {item!r}") for item in parse_list(text, "--capacity"))


def _hardware(args: argparse.Namespace) -> HardwareProfile | None:
    if args.model and args.layout:
        raise UserError("--model and --layout are exclusive; give one")
    if args.hardware and not (args.model or args.layout):
        raise UserError("--hardware needs --model or --layout (bytes per block) to model seconds")
    return load_profile(args.hardware) if args.hardware else None


def _layout(args: argparse.Namespace, kind: TraceKind) -> KVLayout | None:
    """The KV layout of ``--model`` or ``--layout``, or None.

    A preset always gets blocks of 512 tokens. A custom layout does too on a request trace
    (a Mooncake ``hash_ids`` entry is 512 tokens); on a step trace it keeps its own
    ``block_tokens`` (256 unless the spec says otherwise).
    """
    if args.model:
        return layout_preset(args.model, MOONCAKE_BLOCK_TOKENS)
    if args.layout:
        return parse_layout(args.layout, MOONCAKE_BLOCK_TOKENS if kind is TraceKind.REQUESTS else None)
    return None


def sweep_from_args(args: argparse.Namespace) -> ResultsDocument:
    """Runs the sweep the options describe; the command recorded is the argv given to ``main``."""
    if args.workers < 0:
        raise UserError(f"--workers: must be >= 0, got {args.workers}")
    trace, spec = spec_from_args(args)
    workers = args.workers or os.cpu_count() or 1
    return sweep(trace, spec, workers, not args.no_progress, shlex.join(["tiercache", *args.argv]))


def check_output_file(path: str, option: str) -> None:
    """Checks, before any work, that ``path`` can receive a file.

    Raises:
        UserError: ``path`` is a folder, its folder is missing or not writable (named).
    """
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UserError(f"{option} {path}: is a folder; give a file name")
    if not os.path.isdir(folder):
        raise UserError(f"{option} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UserError(f"{option} {path}: not writable")


def run(args: argparse.Namespace) -> int:
    """``tiercache replay`` body. The output path is checked before the sweep."""
    if args.out:
        check_output_file(args.out, "--out")
    results = sweep_from_args(args)
    print(format_table(results))
    if args.out:
        write_results(args.out, results, "--out")
        print(f"results written to {args.out}")
    return 0


def format_table(results: ResultsDocument) -> str:
    """A short fixed-width table of the runs."""
    trace = results.trace
    if trace.kind is TraceKind.STEPS:  # reads are the accesses; writes store new blocks
        summary = f"{trace.requests} step records, {trace.accesses} block reads and writes"
    else:
        summary = f"{trace.requests} requests, {trace.accesses} block accesses"
    lines = [f"{trace.name}: {summary}, {trace.unique_blocks} unique blocks"]
    header = f"{'policy':<10} {'semantics':<9} {'capacity':>9} {'hits':>9} {'misses':>9} {'miss ratio':>10}  per-tier hits"
    lines += [header, "-" * len(header)]
    for run in results.runs:
        tiers = " ".join(f"{t.name}={t.hits}" for t in run.tiers)
        lines.append(
            f"{run.policy:<10} {run.semantics.value:<9} {run.capacity_blocks:>9} {run.hits:>9} "
            f"{run.misses:>9} {run.miss_ratio:>10.4f}  {tiers}"
        )
    return "\n".join(lines)
