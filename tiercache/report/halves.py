"""The halves of a ``compare --split`` among the files ``report --across`` reads, and the
policies a split chose among.

``compare --split`` writes the second half's runs to ``results.json`` and the first half's to
``results_first_half.json``; each records the trace's path with ``#first-half`` or
``#second-half`` appended (``results.SPLIT_HALVES``). ``pair_halves`` finds the two again, so that
gaps.md shows the policy tuned on the first half, measured on the second, as split.md does,
instead of the second half's hindsight winner alone. A split chooses among its ``--policy``
list only (``split_candidates``), never among the plain ``lru`` and ``belady`` runs it adds as
the gap's references unless that list names them.
"""

from __future__ import annotations

import shlex
from collections import defaultdict
from dataclasses import dataclass

from ..config import split_items
from ..errors import UserError
from ..policies import ADMISSION, EVICTION, PLACEMENT, canonical_name
from ..results import SPLIT_HALVES as HALVES, ResultsDocument, run_label

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
    """Pairs each second half with the first half of the same split trace (``sources``: each
    document's files).

    A pair is the one first half and the one second half of one trace path whose request counts
    are a split's (``records // 2`` and the rest: the second half holds as many or one more).
    Two halves of one path with other fingerprints (the trace changed between splits) pair with
    nothing, as a second half given alone does; a first half alone is a trace of its own.
    """
    by_path: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for index, document in enumerate(documents):
        if (half := _half(document)) is not None:
            by_path[half[0]][half[1]].append(index)
    tuned_by, notes, unpaired = {}, [], []
    for path, halves in by_path.items():
        firsts, seconds = halves[HALVES[0]], halves[HALVES[1]]
        if len(firsts) == 1 and len(seconds) == 1 and _fits(documents[firsts[0]], documents[seconds[0]]):
            tuned_by[seconds[0]] = firsts[0]
            notes.append(_pair_note(documents, sources, firsts[0], seconds[0]))
        else:
            unpaired += [_unpaired(documents[i], sources[i], path, len(firsts)) for i in seconds]
    return Halves(tuned_by, notes, unpaired)


def _fits(first: ResultsDocument, second: ResultsDocument) -> bool:
    """Whether the two halves' request counts are one split's: the second holds as many or one more."""
    return first.trace.kind == second.trace.kind and 0 <= second.trace.requests - first.trace.requests <= 1


def _pair_note(documents: list[ResultsDocument], sources: list[list[str]], first: int, second: int) -> str:
    return (f"{', '.join(sources[first])} (trace {documents[first].trace.name!r}) is the first half of the split whose "
            f"second half is {', '.join(sources[second])}: it tunes the rows of that half (the policy tuned on it, "
            "measured on the second half, beside the best in hindsight) and has no row of its own")


def _unpaired(document: ResultsDocument, files: list[str], path: str, firsts: int) -> str:
    """Why a second half's row shows only its hindsight winner: no first half, or none that fits."""
    why = ("given without its first half" if not firsts else
           f"given beside {firsts} first half{'s' if firsts > 1 else ''} of that trace path but no one first half that "
           "is its pair (other request counts, or the trace changed between splits)")
    return (f"trace {document.trace.name!r} ({', '.join(files)}) is the second half of a compare --split of {path}, "
            f"{why}: its row's best online policy is the second half's own winner, picked in hindsight, not the policy "
            f"tuned on the first half; give the {FIRST_HALF_FILE} written beside it too for the tuned pick and its gap")
