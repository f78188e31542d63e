"""``tiercache replay``: replay a trace through the manager and print/save per-policy results.

The options are parsed here, once, into a typed ``SweepSpec`` (``spec_from_args``); the
sweep itself is ``tiercache.sim.sweep.sweep``. ``tiercache compare`` shares the options.
"""

from __future__ import annotations

import argparse
import os
import shlex

from ..config import (
    MODEL_PRESETS, SPELLINGS, CacheConfig, Capacity, KVLayout, layout_preset, parse_layout, parse_tiers, split_items,
)
from ..errors import UserError
from .stdout import print_unless_refused
from .fleet import (add_fleet_options, fleet_from_args, format_fleet, is_fleet, refuse_fleet_only_options, split_remote,
                    warn_trace)
from ..results import LayoutInfo, ResultsDocument, Semantics, TraceKind, write_results
from ..results.outfile import check_not_the_trace, check_output_file, same_file
from ..policies import ADMISSION, EVICTION, PLACEMENT, PREFETCH, canonical_name, get_prefetch
from ..sim.hardware import PRESETS, REFERENCE_MODEL, HardwareProfile, load_profile
from ..sim.loader import Trace
from ..sim.oracle import trace_layout
from ..sim.replay import check_placement
from ..sim.steptrace import MAX_BLOCK_TOKENS
from ..sim.sweep import SweepSpec, check_policy_names, sweep
from .tracefile import read_trace

__all__ = ["add_parser", "add_common_options", "sweep_from_args", "traced_sweep_from_args", "spec_from_args", "format_table", "DEFAULT_CAPACITY",
           "Once", "OnceFlag", "policy_names", "check_not_the_trace"]

#: ``--capacity`` when neither it nor ``--tiers`` is given.
DEFAULT_CAPACITY = "4000"

#: What ``tiercache replay --help`` says the command does (the module docstring is for
#: developers). Wrapped by hand: the parser's formatter keeps the epilog's line breaks,
#: and the description's with them.
DESCRIPTION = (
    "Replays a trace through the tier manager: one run per policy, capacity (or the\n"
    "hierarchy of --tiers) and semantics, in worker processes; with --instances, a fleet\n"
    "of engines sharing a remote tier. Prints the hits and misses of each run (per tier;\n"
    "per instance in a fleet) and, with --out, writes the results JSON that tiercache\n"
    "report reads."
)


def parse_list(text: str, option: str) -> list[str]:
    """Splits a comma list, rejecting an empty one or an empty item (``"4,,5"``, ``"lru,"``)."""
    return split_items(text, option)


#: The namespace attribute where ``Once`` and ``OnceFlag`` note the options already given.
_GIVEN = "_options_given"


def _note_once(parser: argparse.ArgumentParser, namespace: argparse.Namespace, action: argparse.Action,
               option_string: str | None, values) -> None:
    """Records that ``action`` was given; a second time is a parser error naming the option
    (both spellings when they differ, ``--out / -o``).

    Counting occurrences, not comparing with the default, lets an option with a default
    (``compare -o``) and an option spelled two ways (``-o``/``--out``) be refused alike.
    """
    given = getattr(namespace, _GIVEN, None)
    if given is None:
        given = {}
        setattr(namespace, _GIVEN, given)
    if action.dest in given:
        first, before = given[action.dest]
        shown = "" if values is None else f" ({before!r} and {values!r})"
        same = option_string if first == option_string else f"{first} / {option_string}"
        parser.error(f"{same} given twice{shown}; give it once")
    given[action.dest] = (option_string, values)


class Once(argparse.Action):
    """Stores an option's value, refusing a second occurrence (argparse would keep the last)
    and an empty value (``--policy=``: argparse would store ``""``, read as not given)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        _note_once(parser, namespace, self, option_string, values)
        if isinstance(values, str) and not values.strip():
            parser.error(f"{option_string}: empty value; give one" + ("" if self.required else " or leave the option out"))
        setattr(namespace, self.dest, values)


class OnceFlag(argparse.Action):
    """A ``store_true`` flag that refuses a second occurrence, as ``Once`` does for values."""

    def __init__(self, option_strings, dest, default=False, help=None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        _note_once(parser, namespace, self, option_string, None)
        setattr(namespace, self.dest, True)


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
    """Options shared by ``replay`` and ``compare`` (the sweep definition); each at most once."""
    parser.add_argument("trace", help="request trace (Mooncake or Bailian JSONL, or a kv-cache-tester file or folder) or decode step trace")
    parser.add_argument("--policy", action=Once, help="comma list of eviction policies (default: lru)")
    parser.add_argument("--capacity", action=Once, help="comma list of single-tier capacities: blocks (4096, 4k = 4,000) "
                                                        f"or sizes with a B unit (16GiB, 512MB; need --model or --layout) "
                                                        f"(default: {DEFAULT_CAPACITY})")
    parser.add_argument("--tiers", action=Once, help="run a hierarchy instead, e.g. hbm=4096,dram=16GiB,nvme=65536; "
                                                     "':int8', ':fp8' or ':int4' after a capacity quantises that tier "
                                                     "(nvme=1TiB:int4: a size then counts quantised blocks) "
                                                     "(sizes need --model or --layout; exclusive with --capacity); "
                                                     "remote=CAP last (replay only): a shared remote tier, see --instances")
    parser.add_argument("--semantics", action=Once, help="object, prefix, or both (= object,prefix) (default: object); "
                                                         "request traces only: step traces replay as decode")
    parser.add_argument("--admission", action=Once, help="admission policy of the lower tiers of --tiers (default: always)")
    parser.add_argument("--placement", action=Once, help="which tier of --tiers new blocks and hits below the top go to: "
                                                         "top (default) or reuse (new blocks start in the second tier; "
                                                         "a hit moves to the top)")
    parser.add_argument("--write-through", action=OnceFlag, help="inclusive hierarchy (default: exclusive)")
    parser.add_argument("--prefetch", action=Once, help="prefetch policy of a step-trace replay, e.g. topk_speculative "
                                                        "(default: none)")
    parser.add_argument("--model", action=Once, help="model preset turning blocks into bytes, e.g. llama-3-8b")
    parser.add_argument("--layout", action=Once, help="custom KV layout instead of --model, "
                                                      "e.g. layers=32,kv_heads=8,head_dim=128,dtype=bfloat16 "
                                                      "(params=N and heads=N, the parameter count and query heads, "
                                                      "give its prefill FLOPs)")
    parser.add_argument("--block-tokens", type=int, action=Once,
                        help="tokens per block of a step trace without a block_tokens header")
    parser.add_argument("--hardware", action=Once, help="hardware preset or profile JSON for modeled seconds, e.g. h200-pcie5-nvme4")
    parser.add_argument("--workers", type=int, action=Once, help="worker processes, >= 1 (default: one per core)")
    parser.add_argument("--no-progress", action=OnceFlag, help="no progress bar")
    parser.add_argument("--no-trace-cache", action=OnceFlag, help="read the trace without the binary trace cache "
                                                                  "($TIERCACHE_TRACE_CACHE, default ~/.cache/tiercache/traces)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``tiercache replay``."""
    parser = subparsers.add_parser("replay", help="replay a trace through the tier manager", description=DESCRIPTION,
                                   epilog=presets_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_options(parser)
    add_fleet_options(parser, Once)
    parser.add_argument("--out", action=Once, help="write results JSON here")
    parser.set_defaults(func=run)


def presets_epilog() -> str:
    """The policies, model presets and hardware presets, for ``--help``."""
    return (f"policies: {', '.join(EVICTION)}\nadmission: {', '.join(ADMISSION)}\nplacement: {', '.join(PLACEMENT)}\n"
            f"prefetch: {', '.join(PREFETCH)}\n"
            f"models: {', '.join(MODEL_PRESETS)}\nhardware: {', '.join(PRESETS)} (or a profile JSON)\n"
            f"capacities: {SPELLINGS}")


def spec_from_args(args: argparse.Namespace) -> tuple[Trace, SweepSpec]:
    """The trace and the sweep the options describe.

    Options that need no trace are checked first, so a typo fails before a long trace is
    read; the layout and the capacities that are sizes follow the trace (its block size).

    Raises:
        UserError: a bad option (named) or a malformed trace (file and line named).
    """
    policies = policy_names(args)
    admission = _named(args.admission, "always", ADMISSION)
    check_policy_names(policies, admission)
    prefetch = _named(args.prefetch, "none", PREFETCH)
    get_prefetch(prefetch)
    placement = _named(args.placement, "top", PLACEMENT)
    semantics = parse_semantics(args.semantics)
    _check_block_tokens(args.block_tokens)
    capacities = _capacities(capacity_text(args))
    hardware = _hardware(args)
    trace = read_trace(args.trace, not args.no_trace_cache, not args.no_progress)
    warn_trace(trace)
    _check_trace_options(args, trace)
    layout = _layout(args, trace)
    cache = _cache(args, layout)
    if args.placement is not None:  # given, even as the default top: refused where it places nothing
        check_placement(placement, cache)
    blocks = tuple(dict.fromkeys(c.to_blocks(layout, f"--capacity {c.text!r}") for c in capacities))  # each once
    return trace, SweepSpec(policies, semantics, blocks, cache, admission, layout, hardware, prefetch, placement)


def policy_names(args: argparse.Namespace) -> tuple[str, ...]:
    """``--policy`` (default ``lru``): the names as registered (``LRU`` -> ``lru``, see
    ``canonical_name``), each once, in the order given. Not loaded here.

    Raises:
        UserError: an empty list or item.
    """
    names = parse_list("lru" if args.policy is None else args.policy, "--policy")
    return tuple(dict.fromkeys(canonical_name(name, EVICTION) for name in names))


def _named(value: str | None, default: str, table: dict[str, str]) -> str:
    """A policy option's name as registered (``default`` when the option is not given)."""
    return default if value is None else canonical_name(value, table)


def parse_semantics(text: str | None) -> tuple[Semantics, ...]:
    """``--semantics``: a comma list of object/prefix, where ``both`` stands for object,prefix;
    each semantics once, in the order given.

    Raises:
        UserError: an empty list or item, or an unknown name.
    """
    names = parse_list("object" if text is None else text, "--semantics")
    expanded = [part for name in names for part in (("object", "prefix") if name.lower() == "both" else (name,))]
    return tuple(dict.fromkeys(Semantics.parse(s) for s in expanded))


def _check_trace_options(args: argparse.Namespace, trace: Trace) -> None:
    """Options that do not apply to the trace's kind are errors, not silently ignored; a
    ``--block-tokens`` that contradicts a step trace's header is one, with or without
    ``--model``/``--layout``."""
    _check_block_tokens_header(args.block_tokens, trace)
    if trace.kind is TraceKind.STEPS and args.semantics is not None:
        raise UserError(f"--semantics {args.semantics}: {trace.path} is a step trace, which always replays as decode "
                        "(reads are accesses, writes new blocks); drop --semantics")
    if trace.kind is TraceKind.REQUESTS and _named(args.prefetch, "none", PREFETCH) != "none":
        raise UserError(f"--prefetch {args.prefetch}: prefetch policies plan decode steps; {trace.path} is a request trace")
    if trace.kind is TraceKind.REQUESTS and args.block_tokens is not None:
        raise UserError(f"--block-tokens: {trace.path} is a request trace, whose blocks are {trace.block_tokens} tokens")


def _cache(args: argparse.Namespace, layout: KVLayout | None) -> CacheConfig | None:
    """The hierarchy of ``--tiers``; ``--admission``/``--write-through`` need two tiers or more."""
    if args.tiers and split_remote(args.tiers)[1] is not None:
        raise UserError(f"--tiers {args.tiers}: a shared remote tier is replayed by tiercache replay (a fleet replay, "
                        "see --instances), not here")
    tiers = parse_tiers(args.tiers, layout) if args.tiers else ()
    if len(tiers) < 2:
        for given, option in ((args.admission, f"--admission {args.admission}"), (args.write_through, "--write-through")):
            if given:
                raise UserError(f"{option}: applies to the lower tiers of a hierarchy; give --tiers with two tiers or more")
    return CacheConfig(tiers, args.write_through) if tiers else None


def _capacities(text: str | None) -> tuple[Capacity, ...]:
    """``"1000,4k,16GiB"`` -> capacities (blocks, or sizes for the layout), in the order given;
    None (``--tiers``) -> (). ``spec_from_args`` replays each block count they come to once
    (``100,0.1k``, or a size and the block count it holds, are one capacity), as policies."""
    if text is None:
        return ()
    return tuple(_capacity(item) for item in parse_list(text, "--capacity"))


def _capacity(item: str) -> Capacity:
    """One ``--capacity`` item. A ``:codec`` after it (``16GiB:int4``) quantises a tier, which
    only ``--tiers`` describes: refused with the ``--tiers`` spelling of a one-tier hierarchy.

    Raises:
        UserError: a codec suffix, or a value ``Capacity.parse`` refuses; names the item.
    """
    if ":" in item:
        raise UserError(f"--capacity {item!r}: a codec after a capacity (':int8', ':fp8', ':int4') quantises a tier "
                        f"of --tiers; give --tiers hbm={item} instead (one tier), not --capacity")
    return Capacity.parse(item, f"--capacity {item!r}")


def _hardware(args: argparse.Namespace) -> HardwareProfile | None:
    if args.model and args.layout:
        raise UserError("--model and --layout are exclusive; give one")
    if args.hardware and not (args.model or args.layout):
        raise UserError("--hardware needs --model or --layout (bytes per block) to model seconds")
    return load_profile(args.hardware).require_prefill() if args.hardware else None


def _layout(args: argparse.Namespace, trace: Trace) -> KVLayout | None:
    """The KV layout of ``--model`` or ``--layout`` as one block of the trace holds it, or None.

    ``trace_layout`` decides the block: a request trace's holds every layer (512 tokens for
    a Mooncake ``hash_ids`` entry), a step trace's one layer (its ids are per-layer blocks),
    of the tokens its header names, or ``--block-tokens`` for a file without one.

    Raises:
        UserError: a step trace of unknown block size, or two sizes that disagree.
    """
    if not (args.model or args.layout):
        return None
    tokens = _block_tokens(args, trace)
    return trace_layout(trace, layout_preset(args.model, tokens) if args.model else parse_layout(args.layout, tokens))


def _check_block_tokens(given: int | None) -> None:
    """``--block-tokens``, when given, must be a size a step trace's header may name: an
    integer in ``[1, MAX_BLOCK_TOKENS]`` (below 2**31, so a block's bytes stay inside int64
    and a results file written with it is one ``report`` reads).

    Raises:
        UserError: outside that range; names the option.
    """
    if given is not None and not 1 <= given <= MAX_BLOCK_TOKENS:
        raise UserError(f"--block-tokens: must be an integer in [1, 2**31) (tokens per block), got {given}")


def _check_block_tokens_header(given: int | None, trace: Trace) -> None:
    """A ``--block-tokens`` that differs from a step trace's header is refused (which size is meant is ambiguous)."""
    named = trace.block_tokens
    if given is not None and named is not None and given != named and trace.kind is TraceKind.STEPS:
        raise UserError(f"--block-tokens {given}: {trace.path} names {named} tokens per block in its header")


def _block_tokens(args: argparse.Namespace, trace: Trace) -> int:
    """The tokens per block of a step trace's blocks: its header's, else ``--block-tokens``.

    Raises:
        UserError: ``--block-tokens`` out of range or contradicting the header, or neither given.
    """
    given, named = args.block_tokens, trace.block_tokens
    _check_block_tokens(given)
    _check_block_tokens_header(given, trace)
    if named is None and given is None:
        raise UserError(f"{trace.path}: the step trace names no block size (no {{\"block_tokens\": N}} header line); "
                        "give --block-tokens to turn its blocks into bytes")
    return named if named is not None else given


def sweep_from_args(args: argparse.Namespace) -> ResultsDocument:
    """Runs the sweep the options describe; the command recorded is the argv given to ``main``."""
    return traced_sweep_from_args(args)[1]


def traced_sweep_from_args(args: argparse.Namespace) -> tuple[Trace, ResultsDocument]:
    """``sweep_from_args``, with the trace it read (for a report that draws from it too)."""
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers: must be at least 1, got {args.workers} (leave it out for one per core)")
    trace, spec = spec_from_args(args)
    workers = args.workers or os.cpu_count() or 1
    return trace, sweep(trace, spec, workers, not args.no_progress, shlex.join(["tiercache", *args.argv]))


def _check_not_the_profile(path: str, hardware: str | None) -> None:
    """Refuses an output file that is the ``--hardware`` profile JSON (a preset names no
    file), before any work.

    Raises:
        UserError: writing ``path`` would overwrite the profile (named).
    """
    if hardware is not None and hardware not in PRESETS and same_file(path, hardware):
        raise UserError(f"--out {path}: is the --hardware profile {hardware}; writing results there would overwrite it "
                        "(give another file)")


def fleet_from_options(args: argparse.Namespace) -> ResultsDocument:
    """The fleet replay of ``--instances`` / ``remote=CAP`` (see ``tiercache.cli.fleet``);
    options that need no trace are checked first, as in ``spec_from_args``."""
    policies = policy_names(args)
    check_policy_names(policies, "always")
    capacity_text(args)  # --capacity beside --tiers is an error here too
    return fleet_from_args(args, policies, _hardware(args), lambda trace: _layout(args, trace))


def run(args: argparse.Namespace) -> int:
    """``tiercache replay`` body. The output path is checked before the sweep (it must be
    neither the trace nor the ``--hardware`` profile JSON), and the results file written
    before the tables are printed (a closed pipe or a full disk under standard output then
    never loses it)."""
    if args.out is not None:
        check_output_file(args.out, "--out")
        check_not_the_trace(args.out, args.trace, "--out")
        _check_not_the_profile(args.out, args.hardware)
    if not is_fleet(args):
        refuse_fleet_only_options(args)
    results = fleet_from_options(args) if is_fleet(args) else sweep_from_args(args)
    if args.out is not None:  # before anything is printed: a reader that goes away cannot lose it
        try:
            write_results(args.out, results, "--out")
        except UserError:  # the file cannot be written: the figures are printed still, then the error
            print_unless_refused(lambda: _print_results(args, results))
            raise
    _print_results(args, results)
    if args.out is not None:
        print(f"results written to {args.out}")
    return 0


def _print_results(args: argparse.Namespace, results) -> None:
    """The tables (fleet or sweep), modeled seconds and layout notes of a replay."""
    if is_fleet(args):
        print(format_fleet(results))
    else:
        print(format_table(results))
        if results.layout is not None:
            print("\n".join(modeled_lines(results)))
    if args.hardware and args.layout:
        print_layout_notes(parse_layout(args.layout), results.hardware)


def print_layout_notes(layout: KVLayout, hardware: str) -> None:
    """One note per prefill figure a custom ``--layout`` leaves unknown: ``params=`` (weight
    FLOPs: the reference model's) and ``heads=`` (query heads: no attention term)."""
    if layout.params is None:
        print(f"note: --layout gives no params=: recompute and TTFT saved use {hardware}'s prefill speed of "
              f"the reference model ({REFERENCE_MODEL}) unscaled; add params=N (the model's parameter count) to scale it")
    if layout.heads is None:
        print("note: --layout gives no heads=: recompute and TTFT saved leave out attention over the context (a flat "
              "per-token rate, lower bounds for long prompts); add heads=N (the model's query heads) to include it")


def format_table(results: ResultsDocument) -> str:
    """A short fixed-width table of the runs."""
    trace = results.trace
    if trace.kind is TraceKind.STEPS:  # reads are the accesses; writes store new blocks
        summary = f"{trace.requests} step records, {trace.accesses} block reads and writes"
    else:
        summary = f"{trace.requests} requests, {trace.accesses} block accesses"
    lines = [f"{trace.name}: {summary}, {trace.unique_blocks} unique blocks"]
    if results.layout is not None:
        lines.append(layout_line(results.layout))
    width = max([10, *(len(run.label) for run in results.runs)])
    header = f"{'policy':<{width}} {'semantics':<9} {'capacity':>9} {'hits':>9} {'misses':>9} {'miss ratio':>10}  per-tier hits"
    lines += [header, "-" * len(header)]
    for run in results.runs:
        tiers = " ".join(f"{t.name}={t.hits}" for t in run.tiers)
        lines.append(
            f"{run.label:<{width}} {run.semantics.value:<9} {run.capacity_blocks:>9} {run.hits:>9} "
            f"{run.misses:>9} {run.miss_ratio:>10.4f}  {tiers}"
        )
    lines += [f"{run.label}: prefetched {run.prefetched} blocks, {run.prefetch_used} read where it put them, "
              f"{run.prefetch_wasted} pushed down or out unread" for run in results.runs
              if run.prefetched is not None and run.prefetch not in (None, "none")]
    return "\n".join(lines)


def modeled_lines(results: ResultsDocument) -> list[str]:
    """Per run, what the layout and hardware model: GiB per link, and with hardware the modeled
    seconds (total, recompute); in prefix semantics the prefill tokens saved and TTFT saved.
    Printed under the table (whose lines stay as they are), e.g. ``lru prefix: GiB moved
    dram->hbm 1.2, hbm->dram 3.4; modeled s total 12.345 (recompute 10); prefill tokens
    saved 1,024 of 3,072; TTFT saved 0.014867 s``."""
    lines = []
    for run in results.runs:
        moved = ", ".join(f"{link} {n / 2**30:.4g}" for link, n in run.bytes_moved.items()) or "none"
        parts = [f"GiB moved {moved}"]
        if run.modeled_seconds:
            seconds = run.modeled_seconds
            parts.append(f"modeled s total {seconds['total']:.6g} (recompute {seconds['recompute']:.6g})")
        if run.prefill_tokens is not None:
            parts.append(f"prefill tokens saved {run.prefill_tokens_saved:,} of {run.prefill_tokens:,}")
        if run.ttft_saved_s is not None:
            parts.append(f"TTFT saved {run.ttft_saved_s:.6g} s")
        lines.append(f"{run.label} {run.semantics.value}: " + "; ".join(parts))
    return lines


def layout_line(info: LayoutInfo) -> str:
    """What one block of the recorded layout holds and costs, e.g. ``layout llama-3-8b: a
    block is 16 tokens of one of its 32 layers' KV, 65,536 B`` (a step trace's per-layer
    block) or ``... 512 tokens of all 32 layers' KV, 67,108,864 B`` (a request trace's).

    Read from the bytes recorded, not from the trace's kind: a block of one layer's bytes
    is one layer's KV.
    """
    if info.layers == 1:
        holds = "its one layer's KV"
    elif info.one_layer:
        holds = f"one of its {info.layers} layers' KV"
    else:
        holds = f"all {info.layers} layers' KV"
    return f"layout {info.name}: a block is {info.block_tokens:,} tokens of {holds}, {info.block_bytes:,} B"
