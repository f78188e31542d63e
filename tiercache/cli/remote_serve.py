"""``tiercache remote-serve``: run a Mooncake Store master for the remote tier.

Starts ``mooncake_master`` with its HTTP metadata server on free ports (or the ports
given), prints what a client's ``RemoteConfig`` needs, and runs until interrupted; the
master is stopped by its pid on the way out. The work is ``tiercache.data.remote_master``.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import signal
import socket
import sys

from ..data.remote_master import exit_status, free_ports, start_master
from ..errors import UserError
from .replay import check_output_file

__all__ = ["add_parser", "main"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``tiercache remote-serve``."""
    p = subparsers.add_parser("remote-serve", help="run a Mooncake Store master for the shared remote tier",
                              description="Start mooncake_master (with its metadata server) on free ports and print "
                                          "the address a client needs; Ctrl-C stops it.")
    p.add_argument("--host", default="127.0.0.1", help="IPv4 address (or name) of this machine to listen on and to advertise "
                   "(default 127.0.0.1)")
    p.add_argument("--rpc-port", type=port_number, help="the master's RPC port, 1..65535 (default: a free one)")
    p.add_argument("--metadata-port", type=port_number, help="the metadata server's port, 1..65535 (default: a free one)")
    p.add_argument("--log", help="append the master's output to this file (default: discarded)")
    p.add_argument("--json", action="store_true", help="print the addresses as one JSON line")
    p.set_defaults(func=main)


def port_number(text: str) -> int:
    """A TCP port as given on the command line: an integer in 1..65535.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse prints it naming the option, exit 2).
    """
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in 1..65535, got {port}")
    return port


def _ports(args: argparse.Namespace) -> tuple[int, int, int]:
    """The (rpc, metadata, metrics) ports: those given, free ones on ``--host`` otherwise.

    Raises:
        UserError: nothing can listen on ``--host`` (an unknown name, an address not on this machine).
    """
    if ":" in args.host:
        raise UserError(f"--host {args.host}: an IPv6 address; a Mooncake master address is host:port, "
                        "give an IPv4 address or a host name")
    if _unspecified(args.host):
        raise UserError(f"--host {args.host!r}: the master listens on the address it advertises, and no client can "
                        "reach 0.0.0.0; give this machine's address that the clients reach")
    given = tuple(port for port in (args.rpc_port, args.metadata_port) if port is not None)
    try:
        picked = iter(free_ports(args.host, 3 - len(given), taken=given))
    except OSError as exc:
        raise UserError(f"--host {args.host}: cannot listen there: {exc.strerror or exc}") from None
    rpc = args.rpc_port or next(picked)
    metadata = args.metadata_port or next(picked)
    metrics = next(picked)
    if rpc == metadata:
        raise UserError(f"--rpc-port and --metadata-port are both {rpc}; give two ports")
    for option, port in (("--rpc-port", args.rpc_port), ("--metadata-port", args.metadata_port)):
        if port is not None:
            _check_free(args.host, port, option)
    return rpc, metadata, metrics


def _unspecified(host: str) -> bool:
    """Whether ``host`` names the unspecified address (``0.0.0.0``, ``0``, ``0.0``, empty):
    every interface, no address a client can use. A name that does not resolve is not (the
    listen check names it)."""
    if not host.strip():
        return True
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_unspecified
    except (OSError, ValueError, UnicodeError):
        return False


def _check_free(host: str, port: int, option: str) -> None:
    """Refuses a port something already listens on: the master would die on bind after its
    readiness check had been answered by that other process.

    Raises:
        UserError: naming the option and the port.
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            why = {errno.EADDRINUSE: "; is another server using it?",
                   errno.EACCES: "; a port below 1024 needs root"}.get(exc.errno, "")
            raise UserError(f"{option} {port}: cannot listen there on {host} ({exc.strerror or exc}){why}") from None


def _exit_on_signal(signum: int, frame) -> None:
    """SIGTERM and SIGHUP end the command with the shell's status for them (143, 129)."""
    raise SystemExit(128 + signum)


def main(args: argparse.Namespace) -> int:
    """Starts the master, prints its addresses, waits; options are checked before it starts.

    Returns 1, saying how, when the master ends on its own (killed, crashed): the command
    never outlives its master, nor ends without a word."""
    if args.log is not None:
        check_output_file(args.log, "--log")
    ports = _ports(args)
    # SIGTERM and SIGHUP (a closed terminal) end the command as Ctrl-C does (exit 143, 129;
    # Ctrl-C 130), from before the master starts: a signal during its startup wait stops it
    # too (``start_master``), so the master never outlives the command. A SIGKILL cannot be
    # caught: the master then stays (stop it by its pid).
    for stop in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, _exit_on_signal)
    master = start_master(args.host, ports=ports, log=args.log)
    try:
        if args.json:
            print(json.dumps({"master": master.master, "metadata": master.metadata, "pid": master.pid}), flush=True)
        else:
            print(f"mooncake_master running (pid {master.pid})\n"
                  f"  master:   {master.master}\n  metadata: {master.metadata}\n"
                  f"  RemoteConfig(master={master.master!r}, metadata={master.metadata!r})\n"
                  "Ctrl-C stops it.", flush=True)
        code = master.process.wait()
        print(f"tiercache remote-serve: error: mooncake_master (pid {master.pid}) ended: {exit_status(code)}"
              + (f"; see {args.log}" if args.log else ""), file=sys.stderr)
        return 1
    finally:
        master.stop()
