"""The halves of a ``compare --split`` among the files ``report --across`` reads, and the
policies a split chose among.

``compare --split`` writes the second half's runs to ``results.json`` and the first half's to
``results_first_half.json``; each records the trace's path with ``#first-half`` or
``#second-half`` appended (``results.SPLIT_HALVES``). ``pair_halves`` finds the two again, so that
gaps.md shows the policy tuned on the first half, measured on the second, as split.md does,
instead of the second half's hindsight winner alone; it pairs only halves shown to be one
split's (side by side in one folder, one command, and not told apart by the trace file's
fingerprint), never the halves of two versions of a trace written to one path. A split
chooses among its ``--policy`` list only (``split_candidates``), never among the plain ``lru``
and ``belady`` runs it adds as the gap's references unless that list names them.
"""

from __future__ import annotations

import os
import shlex
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ..config import split_items
from ..errors import UserError
from ..policies import ADMISSION, EVICTION, PLACEMENT, canonical_name
from ..results import SPLIT_HALVES as HALVES, ResultsDocument, run_label
from ..sim.loader import half_fingerprint, trace_fingerprint

__all__ = ["FIRST_HALF_FILE", "Halves", "offered_labels", "split_candidates", "offered_runs", "pair_halves"]

#: The file ``compare --split`` writes the first half's runs to, beside the second half's results.json.
FIRST_HALF_FILE = "results_first_half.json"


def offered_labels(policies: tuple[str, ...] | list[str], admission: str, placement: str) -> frozenset[str]:
    """The labels of a split's compared runs: each of ``policies`` (names as registered) run
    with ``admission`` and ``placement`` (``arc+tinylfu``)."""
    return frozenset(run_label(policy, admission, placement) for policy in policies)


def split_candidates(command: str) -> frozenset[str] | None:
    """The labels a ``tiercache compare ... --split`` command chose among (``offered_labels``
    of its ``--policy``, ``--admission`` and ``--placement``, as ``compare`` records them);
    None for any other command (a replay's, or none recorded): every run of it was offered."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    if words[:2] != ["tiercache", "compare"] or "--split" not in words[3:]:
        return None
    values = dict(zip(words[3:], words[4:]))  # each option word -> the word after it
    try:
        policies = [canonical_name(name, EVICTION) for name in split_items(values["--policy"], "--policy")]
    except (KeyError, UserError):
        return None
    return offered_labels(policies, canonical_name(values.get("--admission", "always"), ADMISSION),
                          canonical_name(values.get("--placement", "top"), PLACEMENT))


def offered_runs(documents: list[ResultsDocument]) -> frozenset[str] | None:
    """The labels a best online policy of one trace is picked among, over the files that hold
    its runs: a split's ``--policy`` runs (``split_candidates``), every run of any other file;
    None where no file is a split's (every run competes)."""
    picks = [split_candidates(document.command) for document in documents]
    if all(pick is None for pick in picks):
        return None
    return frozenset().union(*(pick if pick is not None else {run.label for run in document.runs}
                               for pick, document in zip(picks, documents)))


@dataclass(frozen=True)
class Halves:
    """The split halves among the documents of ``report --across`` (one per trace).

    Invariants: ``tuned_by`` maps a second half's index to its first half's, each index at most
    once on either side; ``notes`` (stderr) say which file tunes which row; ``unpaired`` holds one
    sentence per second half that has no first half to tune it, for stderr and under the table.
    """

    tuned_by: dict[int, int]
    notes: list[str]
    unpaired: list[str]


def _half(document: ResultsDocument) -> tuple[str, str] | None:
    """(the split trace's path, ``first-half`` or ``second-half``) of a half's document, else None."""
    path = document.trace.path or ""
    return next(((path[: -len(name) - 1], name) for name in HALVES if path.endswith(f"#{name}")), None)


def pair_halves(documents: list[ResultsDocument], sources: list[list[str]]) -> Halves:
    """Pairs each second half with the first half of the same split (``sources``: each
    document's files), only where the two can be shown to be one split's (``_why_not``):

    - the first half's file is the ``results_first_half.json`` in the folder of the second
      half's file (``compare --split`` writes them side by side);
    - both record the same command and trace path, and request counts that are a split's
      (``records // 2`` and the rest: the second half holds as many or one more);
    - where the trace file lies at its recorded path, its fingerprint does not tell them
      apart: each half records ``digest(whole#half)`` (``half_fingerprint``), and halves of
      which only one matches the file now were split from two versions of it (the trace
      changed between splits). Where neither matches (the file changed since, or another
      lies there) the folder and the command decide.

    A second half with no such first half (or with several) pairs with nothing and keeps its
    hindsight row, with a sentence in ``unpaired`` saying why; a first half not paired is a
    trace of its own. The trace file is read only where a pair passes the other checks.
    """
    by_path: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for index, document in enumerate(documents):
        if (half := _half(document)) is not None:
            by_path[half[0]][half[1]].append(index)
    tuned_by, notes, unpaired = {}, [], []
    for path, halves in by_path.items():
        firsts, seconds = halves[HALVES[0]], halves[HALVES[1]]
        elsewhere = [f"{', '.join(sources[f])}: a first half of a split of another trace path, {other}"
                     for other, their in by_path.items() if other != path for f in their[HALVES[0]]]
        whole = _WholeTrace(path)
        why = {(f, s): _why_not(documents[f], sources[f], documents[s], sources[s], whole) for f in firsts for s in seconds}
        for second in seconds:
            fitting = [f for f in firsts if why[f, second] is None]
            if len(fitting) == 1 and sum(why[fitting[0], s] is None for s in seconds) == 1:
                tuned_by[second] = fitting[0]
                notes.append(_pair_note(documents, sources, fitting[0], second))
            else:
                ambiguous = "one of several first halves that fit it" if len(fitting) > 1 else "it fits another second half too"
                reasons = [f"{', '.join(sources[f])}: {why[f, second] or ambiguous}" for f in firsts] + elsewhere
                unpaired.append(_unpaired(documents[second], sources[second], path, reasons))
    return Halves(tuned_by, notes, unpaired)


class _WholeTrace:
    """The split halves' fingerprints of the trace file at ``path`` as it is now, computed once,
    on first use (None: not a readable regular file)."""

    def __init__(self, path: str) -> None:
        self.path, self._halves, self._read = path, None, False

    def halves(self) -> tuple[str, str] | None:
        """(first half's, second half's) fingerprint of a split of the file now, or None."""
        if not self._read:
            self._read = True
            try:
                if Path(self.path).is_file():
                    whole = trace_fingerprint(self.path)
                    self._halves = (half_fingerprint(whole, HALVES[0]), half_fingerprint(whole, HALVES[1]))
            except (UserError, OSError):
                pass  # unreadable now: the folder and the command decide
        return self._halves


def _why_not(first: ResultsDocument, first_files: list[str], second: ResultsDocument, second_files: list[str],
             whole: _WholeTrace) -> str | None:
    """Why ``first`` is not the first half of ``second``'s split (see ``pair_halves``), or None."""
    if not _fits(first, second):
        return "other request counts than one split's halves"
    if not any(_same_file(f, Path(s).parent / FIRST_HALF_FILE) for f in first_files for s in second_files):
        return f"not the {FIRST_HALF_FILE} in the folder of the second half's file"
    if first.command != second.command:
        return "it records another command"
    expected = whole.halves()
    if expected is not None and (first.trace.fingerprint == expected[0]) != (second.trace.fingerprint == expected[1]):
        return (f"the trace file {whole.path} now splits into only one of the two halves' fingerprints: the trace "
                "changed between the two splits")
    return None


def _same_file(a: str, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one existing file (any spelling, a link)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _fits(first: ResultsDocument, second: ResultsDocument) -> bool:
    """Whether the two halves' request counts are one split's: the second holds as many or one more."""
    return first.trace.kind == second.trace.kind and 0 <= second.trace.requests - first.trace.requests <= 1


def _pair_note(documents: list[ResultsDocument], sources: list[list[str]], first: int, second: int) -> str:
    return (f"{', '.join(sources[first])} (trace {documents[first].trace.name!r}) is the first half of the split whose "
            f"second half is {', '.join(sources[second])}: it tunes the rows of that half (the policy tuned on it, "
            "measured on the second half, beside the best in hindsight) and has no row of its own")


def _unpaired(document: ResultsDocument, files: list[str], path: str, reasons: list[str]) -> str:
    """Why a second half's row shows only its hindsight winner: no first half given, or none
    that is shown to be its pair (``reasons``: one per first half of that path, naming it)."""
    why = ("given without its first half" if not reasons else
           f"given beside {len(reasons)} first half{'s' if len(reasons) > 1 else ''} but no one first half "
           f"shown to be its pair ({'; '.join(reasons)})")
    return (f"trace {document.trace.name!r} ({', '.join(files)}) is the second half of a compare --split of {path}, "
            f"{why}: its row's best online policy is the second half's own winner, picked in hindsight, not the policy "
            f"tuned on the first half; give the {FIRST_HALF_FILE} written beside it too for the tuned pick and its gap")
