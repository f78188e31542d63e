"""The ``tiercache`` command: a thin dispatcher over subcommand modules.

Each subcommand module exposes ``add_parser(subparsers)``, which registers its parser and
sets ``func`` (a callable taking the parsed namespace and returning an exit code). Bad user
input raises ``UserError``; it is printed as one line, without a traceback, and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import UserError

# Modules that register subcommands, in the order they appear in ``--help``.
_SUBCOMMAND_MODULES = (
    "tiercache.sim.replay_cli",
    "tiercache.sim.trace_cli",
    "tiercache.report.cli",
    "tiercache.data.bench_cli",
)


def build_parser() -> argparse.ArgumentParser:
    """Builds the top-level parser with every available subcommand."""
    parser = argparse.ArgumentParser(prog="tiercache", description="Tiered KV-cache manager and trace replayer.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module_name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:  # a real import failure inside the module
                raise
            continue  # not built yet
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"tiercache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tiercache: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
