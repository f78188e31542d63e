"""``tiercache replay --instances N --tiers hbm=..,dram=..,remote=CAP``: the fleet replay.

A ``remote=CAP`` entry in ``--tiers`` (always last) makes ``tiercache replay`` replay the
trace over ``--instances`` engine instances (default 1: one engine whose last tier is the
remote one), each with the private tiers before it, plus one shared remote tier of CAP
blocks (or a size with ``--model``/``--layout``). Per policy the results file holds the run
with the shared tier and the same fleet on private tiers alone. Options are checked here;
the work is ``tiercache.sim.fleet`` and the tables ``tiercache.report.fleet``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Callable

from ..config import REMOTE_TIER, Codec, KVLayout, RemoteWrite, Route, TraceKind, parse_capacity, parse_tiers, split_items
from ..policies import ADMISSION, PLACEMENT, PREFETCH, canonical_name
from ..errors import UserError
from ..remote_config import DEFAULT_WRITE_HITS
from ..report.fleet import (LISTED_INSTANCES, fleet_pairs, fleet_summary_table, fleet_table, gain_sentence, summary_note, tenths,
                            write_text)
from ..results import ResultsDocument
from ..sim.fleet import FleetSpec, check_fleet_policy, sweep_fleet
from ..sim.hardware import NETWORK_PRESETS, HardwareProfile, with_network
from ..sim.kvtester import skipped_entries_warning
from ..sim.loader import Trace
from ..sim.tracestats import block_fit_warning
from .tracefile import read_trace

__all__ = ["add_fleet_options", "is_fleet", "fleet_from_args", "format_fleet", "warn_trace"]


def add_fleet_options(parser: argparse.ArgumentParser, once: type[argparse.Action]) -> None:
    """``--instances``, ``--route``, ``--remote-write``, ``--write-hits`` and ``--network`` of ``tiercache replay``."""
    parser.add_argument("--instances", type=int, action=once,
                        help="replay over N engine instances sharing the remote tier of --tiers (remote=CAP, last); "
                             "each instance has the tiers before it (default with remote=CAP: 1)")
    parser.add_argument("--route", choices=[r.value for r in Route], action=once,
                        help="how a fleet replay spreads requests over the instances (default: round_robin)")
    parser.add_argument("--remote-write", choices=[w.value for w in RemoteWrite], action=once,
                        help="when a fleet's instances write to the shared tier, as the live store's remote_write: "
                             "through (default: each request's blocks once computed), back (only victims of the last "
                             "private tier), selective (a block once hit --write-hits times locally)")
    parser.add_argument("--write-hits", type=int, action=once,
                        help=f"local hits after which --remote-write selective writes a block (default: {DEFAULT_WRITE_HITS})")
    parser.add_argument("--network", choices=list(NETWORK_PRESETS), action=once,
                        help="network of the shared remote tier with --hardware (default: tcp-25g, unless the "
                             "profile JSON gives remote->dram and dram->remote)")


def split_remote(tiers: str | None) -> tuple[str | None, str | None]:
    """``"hbm=1000,dram=4000,remote=16000"`` -> ``("hbm=1000,dram=4000", "16000")``.

    ``remote`` is matched in any case (``REMOTE=16000``), as ``parse_tiers`` matches the
    private tiers' names.

    Raises:
        UserError: an empty item (``hbm=2,,remote=4``), or the remote entry is not the last
            one, or repeats.
    """
    if not tiers:
        return tiers, None
    parts = split_items(tiers, "--tiers")
    remote = [i for i, p in enumerate(parts) if p.partition("=")[0].strip().lower() == REMOTE_TIER]
    if not remote:
        return tiers, None
    if remote != [len(parts) - 1]:
        raise UserError(f"--tiers {tiers}: remote=CAP must be given once, as the last tier (the shared tier lies "
                        "behind every private one)")
    return ",".join(parts[:-1]), parts[-1].partition("=")[2].strip()


def is_fleet(args: argparse.Namespace) -> bool:
    """A fleet replay: ``--instances`` or a ``remote=`` tier (both checked by ``fleet_from_args``)."""
    return args.instances is not None or split_remote(args.tiers)[1] is not None


def _check_options(args: argparse.Namespace, remote: str | None) -> None:
    """Options a fleet replay cannot honour are errors naming the option, never ignored."""
    if args.instances is not None and remote is None:
        raise UserError(f"--instances {args.instances}: the instances of a fleet replay share a remote tier; add "
                        "remote=CAP to --tiers as its last tier (e.g. --tiers hbm=1000,dram=4000,remote=16000)")
    if args.instances is not None and args.instances < 1:
        raise UserError(f"--instances: must be at least 1, got {args.instances}")
    semantics = None if args.semantics is None else [s.strip().lower() for s in args.semantics.split(",")]
    refused = ((f"--semantics {args.semantics}", semantics not in (None, ["prefix"]), "it runs in prefix semantics"),
               (f"--admission {args.admission}", _is_not(args.admission, "always", ADMISSION), "its tiers admit every block"),
               (f"--placement {args.placement}", _is_not(args.placement, "top", PLACEMENT),
                "new blocks and hits go to the top tier"),
               ("--write-through", args.write_through, "its private tiers are exclusive"),
               (f"--prefetch {args.prefetch}", _is_not(args.prefetch, "none", PREFETCH), "prefetch plans decode steps"),
               ("--block-tokens", args.block_tokens is not None, "request traces name their own block size"),
               (f"--workers {args.workers}", args.workers not in (None, 1), "it runs in one process"))
    for option, given, why in refused:
        if given:
            raise UserError(f"{option}: does not apply to a fleet replay (remote=CAP in --tiers): {why}")
    _check_write_hits(args)


_WRITES_WITHOUT_HITS = {"through": "through writes every block it computes",
                        "back": "back writes the victims of the last private tier"}


def _check_write_hits(args: argparse.Namespace) -> None:
    """``--write-hits`` only with ``--remote-write selective``, an integer in [1, 2**63) (what a
    results file records)."""
    if args.write_hits is None:
        return
    write = args.remote_write or RemoteWrite.THROUGH.value
    if write != RemoteWrite.SELECTIVE.value:
        raise UserError(f"--write-hits {args.write_hits}: applies to --remote-write selective ({_WRITES_WITHOUT_HITS[write]})")
    if not 1 <= args.write_hits < 2**63:
        raise UserError(f"--write-hits: must be an integer in [1, 2**63), got {args.write_hits}")


def _is_not(value: str | None, default: str, table: dict[str, str]) -> bool:
    """A policy option given as another policy than ``default`` (names matched as registered)."""
    return value is not None and canonical_name(value, table) != default


def refuse_fleet_only_options(args: argparse.Namespace) -> None:
    """``--route``, ``--remote-write``, ``--write-hits`` and ``--network`` without a remote tier are
    errors (a one-engine replay)."""
    for option, value in (("--route", args.route), ("--remote-write", args.remote_write), ("--write-hits", args.write_hits),
                          ("--network", args.network)):
        if value is not None:
            raise UserError(f"{option} {value}: applies to a fleet replay; add remote=CAP as the last tier of --tiers")


def _network(args: argparse.Namespace, hardware: HardwareProfile | None) -> HardwareProfile | None:
    """The hardware with the shared tier's network links."""
    if hardware is None:
        if args.network is not None:
            raise UserError(f"--network {args.network}: models the shared tier's links; give --hardware (and --model) too")
        return None
    if "remote->dram" in hardware.links and "dram->remote" in hardware.links:  # a profile JSON that gives them itself
        if args.network is not None:
            raise UserError(f"--network {args.network}: hardware profile {hardware.source or hardware.name} gives the "
                            "shared tier's links (remote->dram, dram->remote) itself; drop --network or those links")
        return hardware
    return with_network(hardware, args.network or "tcp-25g")


def _specs(args: argparse.Namespace, private: str, remote: str, layout: KVLayout | None,
           policies: tuple[str, ...]) -> list[FleetSpec]:
    if not private:
        raise UserError(f"--tiers {args.tiers}: a fleet's instances need private tiers before remote (e.g. hbm=1000,remote=16000)")
    value, _, codec = remote.partition(":")
    if codec:
        raise UserError(f"--tiers remote={remote}: the shared tier stores blocks as given (no :codec)")
    tiers = parse_tiers(private, layout)
    quantised = [t.name for t in tiers if t.codec is not Codec.NONE]
    if quantised:
        raise UserError(f"--tiers {args.tiers}: a fleet replay does not model quantised tiers ({', '.join(quantised)})")
    capacity = parse_capacity(value, layout, "--tiers remote")
    route = Route(args.route or Route.ROUND_ROBIN.value)
    for policy in policies:
        try:
            check_fleet_policy(policy)
        except ValueError as exc:
            raise UserError(f"--policy {policy}: {exc}") from None
    write = RemoteWrite(args.remote_write or RemoteWrite.THROUGH.value)
    hits = DEFAULT_WRITE_HITS if args.write_hits is None else args.write_hits
    return [FleetSpec(args.instances or 1, tiers, capacity, route, policy, write, hits) for policy in policies]


def fleet_from_args(args: argparse.Namespace, policies: tuple[str, ...], hardware: HardwareProfile | None,
                    layout_for: Callable[[Trace], KVLayout | None]) -> ResultsDocument:
    """Runs the fleet replay the options describe.

    Args:
        args: ``tiercache replay``'s options (``is_fleet(args)`` is true).
        policies: the ``--policy`` list, names checked.
        hardware: ``--hardware``'s profile (needs a layout; checked by the caller).
        layout_for: the trace -> the layout of ``--model``/``--layout`` (or None).

    Raises:
        UserError: an option a fleet cannot honour, a bad tier, a step trace.
    """
    private, remote = split_remote(args.tiers)
    _check_options(args, remote)
    profile = _network(args, hardware)
    trace = read_trace(args.trace, not args.no_trace_cache, not args.no_progress)
    warn_trace(trace)
    if trace.kind is not TraceKind.REQUESTS:
        raise UserError(f"{trace.path} is a step trace; a fleet replay (--instances, remote=CAP in --tiers) "
                        "replays request traces")
    layout = layout_for(trace)
    specs = _specs(args, private, remote, layout, policies)
    return sweep_fleet(trace, specs, layout, profile, shlex.join(["tiercache", *args.argv]))


def warn_trace(trace: Trace) -> None:
    """Prints the trace's warning lines on stderr: a workload folder's entries not read
    (``skipped_entries_warning``), and ``block_fit_warning``'s line when a request trace's
    ``hash_ids`` do not fit its prompts (more than 1% of requests); the replay goes on."""
    for warning in (skipped_entries_warning(trace.path), block_fit_warning(trace)):
        if warning:
            print(warning, file=sys.stderr)


def format_fleet(results: ResultsDocument) -> str:
    """Per fleet: the setting, per-instance and shared hits, the gain, bytes and TTFT saved;
    above ``LISTED_INSTANCES`` instances the report's summary rows (min, median, max, the
    extreme instances, all) instead of a row and a TTFT figure per instance."""
    lines = []
    for run, twin in fleet_pairs(results.runs):
        tiers = ",".join(f"{t.name}={t.capacity_blocks}" for t in run.tiers)
        shared = " (remote: shared)" if run.shared_writes is not None else " (no shared tier)"
        lines.append(f"{results.trace.name}: {results.trace.requests} requests over {len(run.instances)} instance(s) "
                     f"({run.route.value}), {run.label}{write_text(run, ', ')}, tiers {tiers}{shared}, prefix semantics")
        many = len(run.instances) > LISTED_INSTANCES
        if many:
            lines.append(summary_note(len(run.instances)))
        lines += _aligned(fleet_summary_table(run) if many else fleet_table(run))
        if twin is not None:
            lines.append(gain_sentence(run, twin))
        if run.bytes_moved:
            lines.append("bytes moved (all instances): "
                         + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in sorted(run.bytes_moved.items())))
        if run.ttft_saved_s is not None and not many:
            lines.append(f"modeled TTFT saved ({results.hardware}) per instance: "
                         + ", ".join(f"{tenths(r.ttft_saved_s)} s" for r in run.instances))
    return "\n".join(lines)


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
