"""The ``tiercache`` command: a thin dispatcher over one module per subcommand.

Each subcommand module (``replay``, ``trace``, ``report``, ``bench``, ``remote_serve``) exposes
``add_parser(subparsers)``, which registers its parser and sets ``func`` (a callable taking
the parsed namespace and returning an exit code). The modules parse options and print;
the work is library code. Bad user input raises ``UserError``; it is printed as one line,
without a traceback, and exits 2. Nothing in the library imports this package.
"""

from __future__ import annotations

import argparse
import select
import signal
import sys

import tiercache

from ..bench.script_args import ScriptParser
from ..core.interrupts import raise_on_sigterm
from ..errors import UserError, out_of_memory
from ..extras import missing_extra
from . import bench, remote_serve, replay, report, trace
from .stdout import StdoutRefused, guarded_stdout, silence_stdout

__all__ = ["main", "build_parser"]

# Subcommand modules, in the order they appear in ``--help``.
_SUBCOMMANDS = (replay, trace, report, bench, remote_serve)


def build_parser() -> argparse.ArgumentParser:
    """Builds the top-level parser with every subcommand."""
    parser = ScriptParser(prog="tiercache", description="Tiered KV-cache manager and trace replayer.",
                     epilog=replay.presets_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tiercache {tiercache.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module in _SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code.

    ``argv`` (default ``sys.argv[1:]``) is what a results file records as its command.
    """
    argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    _printable_file_names()
    args = build_parser().parse_args(argv)
    args.argv = argv
    # SIGTERM ends the commands that write files (atomically) as Ctrl-C does: no temporary
    # file is left (bench: its working folder, a throwaway store, is removed). remote-serve
    # keeps its own handler.
    previous_term = raise_on_sigterm() if args.command in ("replay", "trace", "compare", "report", "bench") else None
    try:
        with guarded_stdout():
            code = int(args.func(args) or 0)
            if sys.stdout is not None:  # None: started with standard output closed (print writes nothing)
                sys.stdout.flush()  # a reader that went away, or a full disk, is reported here, not at exit
        return code
    except UserError as exc:
        print(f"tiercache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an optional package (torch for bench): name its extra
        message = missing_extra(exc)
        if message is None:
            raise
        print(f"tiercache {args.command}: error: {message}", file=sys.stderr)
        return 2
    except (MemoryError, SystemError) as exc:  # files being written are replaced whole or not at all (results.outfile)
        if not out_of_memory(exc):
            raise
        print(f"tiercache {args.command}: error: out of memory: this needs more than the machine or the "
              "process's memory limit allows", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tiercache: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_closed_by_reader():
            raise
        return 128 + signal.SIGPIPE  # as a shell reports a command that a closed pipe stopped
    except StdoutRefused as exc:
        silence_stdout()
        print(f"tiercache {args.command}: error: cannot write to standard output ({exc.strerror or exc}); "
              "what it printed is incomplete", file=sys.stderr)
        return 1
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)


def _printable_file_names() -> None:
    """Lets standard output print a file name that is not UTF-8 (Python hands its bytes over
    as lone surrogates) as a ``\\udcff`` escape where it would refuse them (a strict stream, as
    under a ``en_US.UTF-8`` locale; the C locale's stream already writes the bytes as they are)."""
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")


def _stdout_closed_by_reader() -> bool:
    """True when standard output is a pipe whose reader went away (``tiercache ... | head``).
    Standard output is then pointed at ``/dev/null``, so that the interpreter's last flush
    does not fail again."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        closed = any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no real stdout, or no poll() on this platform
        return False
    if closed:
        silence_stdout()
    return closed


if __name__ == "__main__":
    sys.exit(main())
