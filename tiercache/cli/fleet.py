"""``tiercache fleet``: replay a request trace over N instances with a shared remote tier.

Runs the fleet twice, with the shared tier and on private tiers alone, prints per-instance
and shared-tier hits and the gain, and optionally writes JSON and a report. The work is
``tiercache.sim.fleet`` and ``tiercache.report.fleet``.
"""

from __future__ import annotations

import argparse
import json
import shlex

from ..config import TraceKind, layout_preset, parse_capacity, parse_tiers
from ..errors import UserError
from ..report.fleet import fleet_table, gain_sentence, write_fleet_report
from ..sim.fleet import FleetSpec, Route, replay_fleet
from ..sim.hardware import NETWORK_PRESETS, load_profile, with_network
from ..sim.loader import load_trace

__all__ = ["add_parser", "main"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``tiercache fleet``."""
    p = subparsers.add_parser("fleet", help="replay a request trace over N instances with a shared remote tier",
                              description="Replay a request trace over N engine instances, each with private tiers, "
                                          "plus one shared remote tier; compare with private tiers alone.")
    p.add_argument("trace", help="a request trace (Mooncake JSONL)")
    p.add_argument("--instances", type=int, default=4, help="engine instances (default 4)")
    p.add_argument("--route", choices=[r.value for r in Route], default=Route.ROUND_ROBIN.value,
                   help="request routing (default round_robin)")
    p.add_argument("--tiers", default="hbm=1000,dram=4000", help="private tiers of each instance (default hbm=1000,dram=4000)")
    p.add_argument("--remote", default="16000", help="capacity of the shared tier, blocks or a size with --model (default 16000)")
    p.add_argument("--policy", default="lru", help="eviction policy of every tier (default lru)")
    p.add_argument("--model", help="layout preset: turns blocks into bytes moved per link")
    p.add_argument("--hardware", help="hardware preset or profile JSON (needs --model): modeled seconds and TTFT saved")
    p.add_argument("--network", choices=list(NETWORK_PRESETS), default="tcp-25g",
                   help="network of the shared tier with --hardware (default tcp-25g)")
    p.add_argument("--json", help="write both runs' results here")
    p.add_argument("--report", metavar="DIR", help="write report.md and fleet.png here")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.instances < 1:
        raise UserError(f"--instances must be at least 1, got {args.instances}")
    layout = layout_preset(args.model, block_tokens=512) if args.model else None
    if args.hardware and layout is None:
        raise UserError("--hardware needs --model (bytes per block)")
    profile = with_network(load_profile(args.hardware), args.network).require_prefill() if args.hardware else None
    tiers = parse_tiers(args.tiers, layout, args.policy)
    spec = FleetSpec(args.instances, tiers, parse_capacity(args.remote, layout, "--remote"), Route(args.route), args.policy)
    trace = load_trace(args.trace)
    if trace.kind is not TraceKind.REQUESTS:
        raise UserError(f"tiercache fleet: {trace.path} is a step trace; a fleet replays request traces")
    shared = replay_fleet(spec, trace, layout, profile=profile)
    private = replay_fleet(spec, trace, layout, shared=False, profile=profile)
    print(f"{trace.path}: {trace.records} requests over {args.instances} instances ({args.route}), "
          f"private {args.tiers} each, shared remote={spec.remote_blocks}, {args.policy}, prefix semantics")
    _print_table(fleet_table(shared))
    print(gain_sentence(shared, private))
    if layout is not None:
        links: dict[str, int] = {}
        for row in shared["instances"]:
            for link, nbytes in row["bytes_moved"].items():
                links[link] = links.get(link, 0) + nbytes
        print("bytes moved (all instances): " + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in sorted(links.items())))
    if profile is not None:
        print(f"modeled TTFT saved ({profile.name}): {shared['ttft_saved_s']:.1f} s with the shared tier, "
              f"{private['ttft_saved_s']:.1f} s on private tiers alone; per instance: "
              + ", ".join(f"{r['ttft_saved_s']:.1f}" for r in shared["instances"]))
    command = "tiercache " + " ".join(shlex.quote(a) for a in args.argv)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"command": command, "shared": shared, "private": private}, handle, indent=2)
    if args.report:
        print(f"report: {write_fleet_report(shared, private, args.report, command)}")
    return 0


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
