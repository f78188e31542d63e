"""Argument checks the scripts under ``scripts/`` share: bad input ends before any work with
one line naming the option (``ScriptParser.error``: exit 2), never a traceback, and never
after a long run (an output file that cannot be written is refused first).

``ScriptParser`` is the parser every script that takes options builds, and the ``tiercache``
command's too (its subcommands' parsers are of the same class): its errors are one line,
while ``--help`` prints the whole usage.

``positive_int`` (``tiercache.bench.rounds``) checks one count; ``positive_ints`` a comma
list of them; ``non_negative_int`` a count that may be 0; ``seed_int`` a random seed;
``open_share`` a share strictly between 0 and 1; ``existing_folder`` a folder a script creates its temporary files in;
``refuse_bad_outputs`` the files the figures go to; ``add_trace_capacities`` and
``trace_pairs`` the repeatable ``--trace T --capacity 1000,4000`` pairs of the policy scripts.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Callable, Mapping, NoReturn, Sequence

from ..errors import UserError
from ..results.outfile import check_not_the_trace, check_output_file
from .rounds import checked_int, positive_int

__all__ = ["ScriptParser", "add_trace_capacities", "existing_folder", "non_negative_int", "open_share", "positive_float",
           "positive_ints",
           "refuse_bad_outputs", "request_traces", "seed_int", "trace_of", "trace_pairs"]

#: The largest seed ``seed_int`` takes: numpy's and torch's generators take any 32-bit seed,
#: and a script may still add offsets and multiply it without leaving torch's 64 bits.
MAX_SEED = 2**32 - 1


class ScriptParser(argparse.ArgumentParser):
    """The argument parser of the scripts: an error (a bad or missing option, or a
    script's own ``parser.error``) is one line on stderr, ``prog: error: message``, exit 2,
    without argparse's usage block before it; ``--help`` still prints the whole usage.

    Invariant: ``error`` writes exactly one line (line breaks inside the message become
    spaces) and never returns.
    """

    def error(self, message: str) -> NoReturn:
        """Exits 2 after writing ``prog: error: message`` as one line to stderr."""
        one_line = " ".join(part.strip() for part in message.splitlines() if part.strip())
        self.exit(2, f"{self.prog}: error: {one_line}\n")


def positive_ints(text: str) -> list[int]:
    """argparse type of a comma list of counts (``1000,10000``): each an integer >= 1.

    Raises:
        argparse.ArgumentTypeError: an empty list, or an item that is not a positive integer
            (argparse names the option and exits 2).
    """
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return [positive_int(item) for item in items]


def positive_float(text: str) -> float:
    """argparse type of a scale or spread: a finite number > 0.

    Raises:
        argparse.ArgumentTypeError: not a number, not finite, or not above 0 (argparse names
            the option and exits 2).
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type of a count that may be 0: an integer >= 0.

    Raises:
        argparse.ArgumentTypeError: not an integer, or negative (argparse names the option
            and exits 2).
    """
    return checked_int(text, 0, None, "a non-negative integer")


def seed_int(text: str) -> int:
    """argparse type of a random seed: an integer in ``[0, MAX_SEED]`` (numpy refuses a
    negative seed, torch one past 64 bits).

    Raises:
        argparse.ArgumentTypeError: not an integer, or out of range.
    """
    return checked_int(text, 0, MAX_SEED, "an integer seed", "a seed from 0 to 2**32 - 1")


def open_share(text: str) -> float:
    """argparse type of a share strictly between 0 and 1 (``0.2``): 0, 1, nan and inf are
    refused, for a share whose odds ``p / (1 - p)`` or logarithm a script takes.

    Raises:
        argparse.ArgumentTypeError: not a number, or not in (0, 1).
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0 < value < 1:  # nan fails both comparisons
        raise argparse.ArgumentTypeError(f"expected a share strictly between 0 and 1, got {text}")
    return value


def existing_folder(text: str) -> str:
    """argparse type of a folder the script writes its temporary files in: it must exist,
    be a folder and be writable.

    Raises:
        argparse.ArgumentTypeError: naming the folder and what is wrong with it.
    """
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"folder {text} does not exist")
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is not a folder")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"folder {text} is not writable")
    return text


def refuse_bad_outputs(parser: argparse.ArgumentParser, outputs: Mapping[str, str | os.PathLike | None],
                       check_file: Callable[[str, str], None] = check_output_file,
                       inputs: Sequence[str | os.PathLike] = ()) -> None:
    """Checks, before any work, every output file given (``{option: path}``; None: not
    given) with ``check_file(path, option)``, and that it is none of ``inputs`` (the traces
    read: by resolved path or inode, or a file inside a trace folder,
    ``outfile.check_not_the_trace``); the ``UserError`` raised becomes ``parser.error`` (one
    line with a ``ScriptParser``, exit 2).

    By default the check is ``tiercache.results.outfile.check_output_file``, the one the CLI's
    own ``--out``/``--json`` go through.
    """
    for option, path in outputs.items():
        if path is None:
            continue
        try:
            check_file(os.fspath(path), option)
            for source in inputs:
                check_not_the_trace(os.fspath(path), os.fspath(source), option)
        except UserError as error:
            parser.error(str(error))


def run_script(main: Callable[[], int]) -> int:
    """Runs a script's ``main`` and returns its exit code; bad input found past the option
    checks (a ``UserError``: a size the machine cannot hold) is one line naming the script,
    exit 2, and running out of memory (torch's CPU allocator included) one line, exit 1."""
    prog = os.path.basename(sys.argv[0]) or "script"
    try:
        return main()
    except UserError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as exc:
        if not (isinstance(exc, MemoryError) or "can't allocate memory" in str(exc)):
            raise
        print(f"{prog}: error: out of memory: the sizes asked for need more than this machine has; lower them",
              file=sys.stderr)
        return 1


def add_trace_capacities(parser: argparse.ArgumentParser) -> None:
    """Adds the repeatable ``--trace`` and ``--capacity`` options (one comma list of
    capacities per trace); ``trace_pairs`` checks and pairs them."""
    parser.add_argument("--trace", action="append", help="trace file or kv-cache-tester folder (repeatable)")
    parser.add_argument("--capacity", action="append", type=positive_ints,
                        help="comma list of capacities (blocks) for the --trace before it")


def trace_pairs(parser: argparse.ArgumentParser, args: argparse.Namespace,
                defaults: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    """The (trace, capacities) pairs of ``args`` (``defaults`` where no ``--trace`` is given),
    each capacity of a pair once, in the order given (as a sweep replays ``--capacity``).

    Raises:
        SystemExit: through ``parser.error`` (one line, exit 2): a ``--trace`` without its
            ``--capacity`` (or the reverse), or a trace that does not exist.
    """
    if len(args.trace or []) != len(args.capacity or []):
        parser.error("give one --capacity per --trace")
    pairs = [(path, list(dict.fromkeys(capacities))) for path, capacities in zip(args.trace, args.capacity)] \
        if args.trace else defaults
    for path, _ in pairs:
        if not os.path.exists(path):
            parser.error(f"--trace {path}: no such file or folder")
    return pairs


def request_traces(parser: argparse.ArgumentParser, paths: list[str], load: Callable[[str], Any]) -> dict[str, Any]:
    """Reads each of ``paths`` with ``load`` (``tiercache.sim.loader.load_request_trace``)
    before any replay, so a bad trace ends the script before the first table, not after it;
    returns ``{path: Trace}`` holding the first path's trace only (the others are dropped once
    checked, so memory holds one trace at a time: ``trace_of`` reads them again in turn).

    Raises:
        SystemExit: through ``parser.error`` (one line, exit 2): whatever ``load`` refuses
            (a trace that cannot be read, with the file and line; a step trace).
    """
    traces = {}
    for path in dict.fromkeys(paths):
        try:
            trace = load(path)
        except UserError as exc:
            parser.error(str(exc))
        if not traces:
            traces[path] = trace
        del trace  # not held while the next one loads
    return traces


def trace_of(traces: dict[str, Any], path: str, load: Callable[[str], Any]) -> Any:
    """The trace of ``path``: taken out of ``traces`` (``request_traces``) when it is there,
    else read again with ``load`` (a file changed since raises its UserError)."""
    return traces.pop(path) if path in traces else load(path)
