"""``tiercache remote-serve``: run a Mooncake Store master for the remote tier.

Starts ``mooncake_master`` with its HTTP metadata server on free ports (or the ports
given), prints what a client's ``RemoteConfig`` needs, and runs until interrupted; the
master is stopped by its pid on the way out. The work is ``tiercache.data.remote_master``.
"""

from __future__ import annotations

import argparse
import json
import signal

from ..data.remote_master import free_port, start_master

__all__ = ["add_parser", "main"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``tiercache remote-serve``."""
    p = subparsers.add_parser("remote-serve", help="run a Mooncake Store master for the shared remote tier",
                              description="Start mooncake_master (with its metadata server) on free ports and print "
                                          "the address a client needs; Ctrl-C stops it.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on and to advertise (default 127.0.0.1)")
    p.add_argument("--rpc-port", type=int, default=0, help="the master's RPC port (default: a free one)")
    p.add_argument("--metadata-port", type=int, default=0, help="the metadata server's port (default: a free one)")
    p.add_argument("--log", help="append the master's output to this file (default: discarded)")
    p.add_argument("--json", action="store_true", help="print the addresses as one JSON line")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    ports = (args.rpc_port or free_port(args.host), args.metadata_port or free_port(args.host), free_port(args.host))
    master = start_master(args.host, ports=ports, log=args.log)
    # SIGTERM ends the command as Ctrl-C does, so the master never outlives it.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        if args.json:
            print(json.dumps({"master": master.master, "metadata": master.metadata, "pid": master.pid}), flush=True)
        else:
            print(f"mooncake_master running (pid {master.pid})\n"
                  f"  master:   {master.master}\n  metadata: {master.metadata}\n"
                  f"  RemoteConfig(master={master.master!r}, metadata={master.metadata!r})\n"
                  "Ctrl-C stops it.", flush=True)
        return master.process.wait()
    finally:
        master.stop()
