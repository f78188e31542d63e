"""``tiercache compare`` (run a sweep, write a report) and ``tiercache report`` (from results files).

Both write the same report folder: ``index.html`` (self-contained), ``report.md`` with its
PNG plots, and ``results.csv``. ``compare`` also saves the sweep as ``results.json`` there,
so reports of sweeps run elsewhere can be merged later with ``tiercache report``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..config import parse_layout
from ..errors import UserError
from ..report.across import (across_documents, gap_markdown, gap_notes, gap_rows, escape_table_text, left_out, split_rows,
                              repeat_note, tuned_notes, tuned_winners)
from ..report.halves import FIRST_HALF_FILE, Halves, offered_labels, pair_halves
from ..report.document import Paragraph, Section
from ..report.lru_curve import same_trace
from ..report.model import ReportData, from_documents, load_results
from ..report.summary import BASELINE, BELADY, is_offline
from ..report.tables import results_csv
from ..report.writer import check_output_dir, write_folder, write_report
from ..results import ResultsDocument
from ..sim.loader import Trace
from ..sim.split import HALVES, split_halves
from ..sim.sweep import sweep
from .replay import (Once, OnceFlag, add_common_options, capacity_text, policy_names, print_layout_notes, spec_from_args,
                     traced_sweep_from_args)

__all__ = ["add_parser"]


def add_parser(subparsers) -> None:
    """Registers ``tiercache compare`` and ``tiercache report``."""
    compare = subparsers.add_parser(
        "compare", help="replay policies × capacities and write a comparison report",
        description="Replays a trace for every policy, capacity and semantics asked (in worker processes), "
                    "then writes a report folder: index.html, report.md with PNG plots, results.csv, results.json.",
    )
    add_common_options(compare)
    compare.add_argument("-o", "--out", action=Once, default="report", help="report folder (default: report)")
    compare.add_argument("--split", action=OnceFlag,
                         help="replay the first and second half of the trace apart (each from a cold cache); name the "
                              "winner per capacity among the --policy list on the first half and report the gap it "
                              "closes on the second (plain lru and belady runs are added as references, without "
                              "--admission or --placement, and are picked only where --policy names them); the report "
                              "is of the second half")
    compare.set_defaults(func=run_compare)
    report = subparsers.add_parser(
        "report", help="build a comparison report from saved results.json files",
        description="Merges results files of one trace (from tiercache replay --out or compare) into a report folder.",
    )
    report.add_argument("results", nargs="+", help="results JSON files, all from the same trace")
    report.add_argument("-o", "--out", action=Once, default="report", help="report folder (default: report)")
    report.add_argument("--trace", action=Once, help="the trace file (or kv-cache-tester folder), if it is no longer at the path "
                                        "the results record (needed only for the dense one-pass LRU curve)")
    report.add_argument("--across", action=OnceFlag,
                        help="results of different traces: write gaps.md, the best online policy and the gap it "
                             "closes per trace and capacity, instead of a one-trace report")
    report.set_defaults(func=run_report)


def run_compare(args: argparse.Namespace) -> int:
    """``tiercache compare``: sweep, then report. The output folder is checked before the sweep."""
    profile = [args.hardware] if args.hardware and os.path.exists(args.hardware) else []  # a preset names no file
    _check_inputs_outside(args.out, [args.trace, *profile])  # first: the more telling refusal of the two
    check_output_dir(args.out)
    _require_plotting("compare")
    started = time.perf_counter()
    command = _compare_command(args)
    if args.split:
        return _run_split(args, command, started)
    # The reproducible form of the command, not whatever argv the caller had.
    trace, results = traced_sweep_from_args(args)
    results = replace(results, command=command)
    swept = time.perf_counter()
    data = from_documents([results], [str(Path(args.out) / "results.json")])
    _write(args.out, data, trace, command, results)  # the trace read once: the report's LRU curve is drawn from it
    _layout_notes(args, results)
    print(f"{len(data.runs)} runs: trace read and replayed in {swept - started:.1f} s, report written in "
          f"{time.perf_counter() - swept:.1f} s")
    return 0


def _require_plotting(command: str) -> None:
    """Refuses, before any work, a command that draws plots where matplotlib cannot be
    imported (a declared dependency: only a broken install lacks it).

    Raises:
        UserError: names the missing package and how to install it.
    """
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        raise UserError(f"{command} draws its plots with matplotlib, which cannot be imported ({exc}); install it "
                        "(pip install matplotlib), or save runs with `tiercache replay --out FILE` and compare them with "
                        "`tiercache report --across FILE...`, which draws none") from None


def run_report(args: argparse.Namespace) -> int:
    """``tiercache report``: merge results files into a report."""
    if args.across and args.trace:
        raise UserError("--trace and --across are exclusive: gaps.md reads no trace (--trace only locates the trace of "
                        "a one-trace report, for its one-pass LRU curve)")
    _check_inputs_outside(args.out, [*args.results, *([args.trace] if args.trace else [])])
    check_output_dir(args.out)
    if args.across:
        return _run_across(args)
    _require_plotting("report")
    data = load_results(args.results)
    if args.trace:
        _check_trace(args.trace, data)
    command = shlex.join(["tiercache", "report", *args.results, "-o", args.out] + (["--trace", args.trace] if args.trace else []))
    _write(args.out, data, args.trace, command, None)
    for repeat in data.repeats:  # once the report is written: an error ends the command in one line
        print(f"tiercache report: note: {repeat_note(repeat, data.trace.name)}", file=sys.stderr)
    return 0


def _run_split(args: argparse.Namespace, command: str, started: float) -> int:
    """``compare --split``: tune on the first half, report on the second (see the option's help).

    The options are checked as given (an error quotes ``--policy`` as typed), and the trace
    must split, before the references are added: plain ``lru`` and ``belady`` runs
    (``SweepSpec.references``), the runs a gap closed is measured against, whatever
    ``--admission`` and ``--placement`` the compared policies run with. The tuned and the
    hindsight winners are picked among the ``--policy`` runs only (``offered_labels``): a
    reference competes only where ``--policy`` names it, with the same admission and placement.
    """
    if not args.policy:
        raise UserError("--split: give the policies to choose among with --policy")
    _check_online_policy(args)
    trace, spec = spec_from_args(args)
    try:
        halves = split_halves(trace)
    except ValueError as exc:
        raise UserError(f"--split: {exc}") from None
    spec = replace(spec, references=(BASELINE, BELADY))
    workers = args.workers or os.cpu_count() or 1
    tune, test = (replace(sweep(h, spec, workers, not args.no_progress), command=command) for h in halves)
    offered = offered_labels(spec.policies, spec.admission, spec.placement)
    data = from_documents([test], [str(Path(args.out) / "results.json")])
    table = gap_markdown(split_rows(tune, test, offered))
    first, total = tune.trace.requests, tune.trace.requests + test.trace.requests
    cold = _cold_halves(first, total)
    # The second half in memory draws its dense LRU curve: no file holds it.
    _write(args.out, data, halves[1], command, test, {
        FIRST_HALF_FILE: json.dumps(tune.to_json(), indent=1),
        "split.md": "# Tuned on the first half, reported on the second\n\n" + escape_table_text(cold) + "\n\n" + table,
    }, Section("Split halves", (Paragraph(
        f"This report is of the second half of the trace. {cold} The first half's runs are in "
        "results_first_half.json. The key findings and the table of the summary lead, as split.md does, with the "
        "policy tuned on the first half in each cache and the gap it closes on this half; the best in hindsight "
        "beside it is the policy that did best on this half itself, known only after it was run."),)),
        (tuned_winners(tune, offered), offered))
    print(table, end="")
    print(cold)
    _layout_notes(args, test)
    print(f"{len(tune.runs) + len(test.runs)} runs in {time.perf_counter() - started:.1f} s")
    return 0


def _check_online_policy(args: argparse.Namespace) -> None:
    """Refuses a ``--split`` whose ``--policy`` list is offline policies alone (Belady's,
    which read the future): there is nothing to tune on the first half, as a tuned policy
    must run without the future. Before the trace is read; an unknown name passes here
    (it is no offline policy) and is refused with the other options.

    Raises:
        UserError: names ``--policy`` as given.
    """
    if all(is_offline(name) for name in policy_names(args)):
        raise UserError(f"--split: --policy {args.policy} names no online policy to tune (an offline policy reads the "
                        "future, which a policy tuned on the first half cannot); add one, e.g. --policy lru")


def _layout_notes(args: argparse.Namespace, results: ResultsDocument) -> None:
    """The notes ``replay`` prints for a custom ``--layout`` that leaves a prefill figure unknown."""
    if args.hardware and args.layout:
        print_layout_notes(parse_layout(args.layout), results.hardware)


def _cold_halves(first: int, total: int) -> str:
    """The sentence split.md and the split report state: how the halves were replayed."""
    return (f"Each half is replayed from a cold cache, as a trace of its own: the first half is requests 1-{first}, the "
            f"second requests {first + 1}-{total}, and nothing the first half stored carries over, so the second half's "
            "figures (LRU's, Belady's and every policy's) count as misses the first uses of blocks the first half had "
            "already used. Every miss ratio and gap closed in split.md is of the second half; the policy tuned on the "
            "first half is the --policy run with the lowest miss ratio there (the lru and belady runs added as "
            "references compete only where --policy names them), and the best in hindsight is picked among the same.")


def _run_across(args: argparse.Namespace) -> int:
    """``report --across``: one gap table over results files of any traces, each trace's runs
    once (notes on stderr name the files and runs counted once and fleet runs left out). The
    two halves of a ``compare --split`` given together are one row per cache with split.md's
    columns (``pair_halves``: the first half tunes, the second is reported); a second half
    given alone is named, its row being the hindsight winner. Why a row reads n/a
    (``gap_notes``, ``tuned_notes``) is said on stderr and under the table; a trace, or a cache
    of one, with no row is named on stderr and under the table.

    Raises:
        UserError: the table would have no row (nothing is written then).
    """
    documents, notes, sources, offered = across_documents(args.results)
    halves = pair_halves(documents, sources)
    shown = [i for i in range(len(documents)) if i not in halves.tuned_by.values()]  # a first half paired tunes only
    explained = halves.unpaired + [note for i in shown for note in gap_notes(documents[i], offered[i])]
    missing = [sentence for i in shown if (sentence := left_out(documents[i], sources[i]))]
    rows = [row for i in shown for row in _across_rows(documents, offered, halves, i)]
    explained += tuned_notes(rows, {documents[i].trace.name for i in halves.tuned_by})
    for note in notes + halves.notes + explained + missing:
        print(f"tiercache report: note: {note}", file=sys.stderr)
    if not rows:
        raise UserError("no row for gaps.md: no file holds a one-engine run of an online policy (fleet runs and "
                        "offline policies alone give no best online policy); nothing written")
    table = gap_markdown(rows, missing, explained)
    write_folder(args.out, {"gaps.md": "# Gap closed per trace and capacity\n\n" + table}, None)
    print(table, end="")
    return 0


def _across_rows(documents: list[ResultsDocument], offered: list[frozenset[str] | None], halves: Halves, index: int) -> list:
    """The gaps.md rows of document ``index``: split rows where a first half tunes it, picked
    among the runs both halves offered (``across_documents``), else its hindsight winners."""
    first = halves.tuned_by.get(index)
    if first is None:
        return gap_rows(documents[index], offered[index])
    both = None if offered[first] is None or offered[index] is None else offered[first] | offered[index]
    return split_rows(documents[first], documents[index], both)


def _write(out: str, data: ReportData, trace: str | Trace | None, command: str, results: ResultsDocument | None,
           extra: dict[str, str] | None = None, first: Section | None = None,
           split: tuple[dict[tuple, str], frozenset[str]] | None = None) -> None:
    """Writes the report folder (with the ``extra`` files, name -> text, and ``first`` as the
    report's first section) all at once and says what it holds; ``trace`` as ``build_document``
    takes it, ``split`` its ``tuned`` and ``candidates``."""
    from ..report.content import build_document  # loads matplotlib: only a command that draws plots needs it

    document = build_document(data, trace, command, *(split or ()))
    if first is not None:
        document = replace(document, sections=(first, *document.sections))
    names = write_report(out, document, results_csv(data), results, data.version, extra)
    plots = sum(name.endswith(".png") for name in names)
    others = ", ".join(n for n in names if not n.endswith(".png"))
    folder = Path(out)
    print(f"report written to {folder}: {others} and {plots} plots (open {folder / 'index.html'})")


def _check_inputs_outside(out: str, inputs: list[str]) -> None:
    """Refuses an ``-o`` folder that holds one of the command's inputs, before any work: the
    folder is replaced as a whole, which would delete that input.

    Raises:
        UserError: names the input and the folder.
    """
    folder = os.path.realpath(out)
    for path in inputs:
        if os.path.commonpath([folder, os.path.realpath(path)]) == folder:
            raise UserError(f"-o {out}: holds {path}, an input of this command; writing the report replaces the "
                            "folder and would delete it (give another folder)")


def _check_trace(path: str, data: ReportData) -> None:
    """An explicit ``--trace`` (a file, or a kv-cache-tester folder) must be the trace the results came from."""
    half = next((h for h in HALVES if (data.trace.path or "").endswith(f"#{h}")), None)
    if half and not os.path.exists(data.trace.path):  # a half's fingerprint is no file's
        raise UserError(f"--trace {path}: these results are of the {half.replace('-', ' ')} of a trace (compare --split), "
                        "which no file holds, so no --trace can match them (the report compare --split writes draws "
                        "the one-pass LRU curve)")
    if not same_trace(path, data.trace.fingerprint):  # an older result's blake2b too
        raise UserError(f"--trace {path}: not the trace of these results (fingerprint differs from {data.trace.fingerprint})")


def _compare_command(args: argparse.Namespace) -> str:
    """The command line that reruns this sweep (options that change no result are left out)."""
    words = ["tiercache", "compare", args.trace, "--policy", args.policy or "lru"]
    words += ["--tiers", args.tiers] if args.tiers else ["--capacity", capacity_text(args)]
    if args.write_through:
        words.append("--write-through")
    if getattr(args, "split", False):
        words.append("--split")
    options = (("--semantics", args.semantics), ("--admission", args.admission), ("--placement", args.placement),
               ("--prefetch", args.prefetch), ("--model", args.model), ("--layout", args.layout),
               ("--block-tokens", args.block_tokens), ("--hardware", args.hardware))
    for option, value in options:
        if value is not None and value != "always":
            words += [option, str(value)]
    return shlex.join(words + ["-o", args.out])
