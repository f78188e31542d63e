"""Gap-closed tables across traces and across the halves of one trace.

Each row is one (trace, semantics, mode, tier layout): LRU's and Belady's miss ratios over
those tiers, the best online policy there (named) and the share of the LRU-to-Belady gap it
closes. Two hierarchies of one total capacity are two rows, each against its own LRU and Belady. A split table
adds what a comparison that cannot be fooled by hindsight reports: the winner picked on the
first half of a trace and the gap it closes on the second half (``report --across`` pairs the
halves of a split it is given: ``halves.pair_halves``). A gap closed above 100% (a
policy that missed less than Belady's replay, possible in prefix semantics and in hierarchies,
where Belady's MIN is not the optimum) is shown as it is, marked, with a note under the table.

A trace is its fingerprint (the digest of its bytes), not its file name: ``across_documents``
merges every results file of one trace into one document, so a run given twice (a copied
results file, a replay saved twice) is one run, and each trace and cache is one row. A file
written before fingerprints became xxh3-128 (blake2b) joins the trace whose file still lies at
its recorded path with the bytes it fingerprinted (``same_trace``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from ..errors import UserError
from ..results import ResultsDocument
from ..results.records import FINGERPRINT_PREFIX, legacy_fingerprint
from ..sim.loader import trace_fingerprint
from . import fmt
from .halves import offered_runs
from .lru_curve import same_trace
from .markdown import escape_markdown
from .model import Repeat, Run, distinct_paths, merge_runs, read_documents
from .summary import (
    BASELINE, BELADY, BEYOND_BELADY, OWN_NOT_BOUND, OWN_REFERENCES, CapacityBest, best_per_capacity, by_layout, gap_closed,
    gap_text, half_references, is_offline, own_references, tier_layout, unreferenced_prefetch,
)
from .tables import tiers_text, unreferenced_runs

__all__ = ["GapRow", "across_documents", "gap_rows", "gap_notes", "left_out", "split_rows", "gap_markdown", "escape_table_text",
           "SPLIT_HEADER", "tuned_run", "tuned_winners", "tuned_notes", "repeat_note"]

#: Hex digits of a fingerprint shown (at least) where it tells traces of one name apart.
_SHORT_DIGITS = 12


@dataclass(frozen=True)
class GapRow:
    """One cache (tier layout) of one trace; ``tiers`` names it (``HBM 5 + DRAM 35``).

    ``tuned`` (split tables only) is the policy that won on the first half; ``tuned_miss`` and
    ``tuned_gap`` are its figures on the reported half (None when it did not run there).
    ``references`` labels ``lru`` and ``belady`` where they are not the plain runs (``lru+tinylfu``
    and ``belady+tinylfu``: ``summary.references``), else is None.
    """

    trace: str
    semantics: str
    mode: str
    capacity_blocks: int
    tiers: str
    lru: float | None
    belady: float | None
    best: str
    best_miss: float
    best_gap: float | None
    tuned: str | None = None
    tuned_miss: float | None = None
    tuned_gap: float | None = None
    references: tuple[str, str] | None = None


def _cache(entry: CapacityBest) -> tuple:
    """What identifies the cache of an entry: (semantics, mode, tier layout)."""
    return entry.semantics, entry.mode, tier_layout(entry.best)


def _row(trace: str, entry: CapacityBest, **tuned) -> GapRow:
    own = own_references([(entry.lru, entry.belady)]) is not None
    return GapRow(trace, entry.semantics.value, entry.mode.value, entry.capacity_blocks, tiers_text(entry.best),
                  entry.lru.miss_ratio if entry.lru else None, entry.belady.miss_ratio if entry.belady else None,
                  entry.best.label, entry.best.miss_ratio, entry.gap_closed,
                  references=(entry.lru.label, entry.belady.label) if own else None, **tuned)


def across_documents(paths: list[str]) -> tuple[list[ResultsDocument], list[str], list[list[str]],
                                                 list[frozenset[str] | None]]:
    """Reads results files of any traces as one document per trace, notes (one line each)
    on what was counted once and how traces are named, each document's files, and the labels
    its best online policy is picked among (``halves.offered_runs``: a split's ``--policy``
    runs; None: every run).

    Invariants: one document per trace fingerprint (``_trace_identity``: a blake2b one of a
    trace file still at its recorded path counts as that file's xxh3-128 one), in the order
    first given, holding the runs of every file of that trace, each run (``RunRecord.key``,
    prefetch policy included) once (``merge_runs``); a file given twice (by any spelling of its
    path) is read once; traces are named as their first file names them, and traces of one
    name with different fingerprints are told apart by a short fingerprint after the name (as
    many digits as tell them apart, at least 12). Every file left out, run counted once, older
    fingerprint matched and file holding fleet runs (which gaps.md leaves out) has a note.
    The third list holds, for each document, the files its runs came from (first given first);
    the fourth, in the same order, ``offered_runs`` over those files.

    Raises:
        UserError: a file cannot be read (as ``read_documents``), or two files hold one run of
            one trace with different counts (names both: one trace cannot have two rows).
    """
    kept, repeated = distinct_paths(paths)
    notes = [f"{path} is {first} given again: read once" for path, first in repeated]
    documents = read_documents(kept)
    groups: dict[str, list[tuple[ResultsDocument, str]]] = defaultdict(list)
    for document, source in zip(documents, kept):
        groups[_trace_identity(document, source, notes)].append((document, source))
    merged = [_merge_trace(fingerprint, group, notes) for fingerprint, group in groups.items()]
    notes.extend(_fleet_note(document, source) for document, source in zip(documents, kept)
                 if any(run.is_fleet for run in document.runs))
    return (_named_apart(merged, notes), notes, [[source for _, source in group] for group in groups.values()],
            [offered_runs([document for document, _ in group]) for group in groups.values()])


def _trace_identity(document: ResultsDocument, source: str, notes: list[str]) -> str:
    """The fingerprint the document's trace has now: as recorded, except for an earlier
    version's blake2b one whose trace file still lies at the recorded path with those bytes
    (``same_trace``), which is that file's xxh3-128 fingerprint (appends a note saying so).
    A trace not found there, or changed since, keeps its blake2b fingerprint."""
    trace = document.trace
    if not legacy_fingerprint(trace.fingerprint) or not Path(trace.path).is_file():
        return trace.fingerprint
    try:
        if not same_trace(trace.path, trace.fingerprint):
            return trace.fingerprint
        current = trace_fingerprint(trace.path)
    except UserError:  # unreadable now: keep the recorded fingerprint
        return trace.fingerprint
    notes.append(f"{source} records its trace by an older (blake2b) fingerprint; {trace.path} still holds those bytes, "
                 f"whose fingerprint is {current}: its runs join that trace's")
    return current


def _fleet_note(document: ResultsDocument, source: str) -> str:
    """One line on the fleet runs of a file, which gaps.md leaves out."""
    fleet = sum(run.is_fleet for run in document.runs)
    return (f"{source}: {fleet} of its {len(document.runs)} runs are fleet runs (--instances), which are not in gaps.md "
            "(a fleet is a configuration of several engines, not one cache with LRU and Belady references); "
            "tiercache report shows them")


def _merge_trace(fingerprint: str, group: list[tuple[ResultsDocument, str]],
                 notes: list[str]) -> tuple[ResultsDocument, str]:
    """The files of one trace (``fingerprint``, its identity) as one document (the first
    file's, with that fingerprint and the merged runs) and the first file's path; appends a
    note for each name and run counted once."""
    first, first_source = group[0]
    name = first.trace.name
    for document, source in group[1:]:
        if document.trace.name != name:
            notes.append(f"{source} names its trace {document.trace.name!r}, the same trace (fingerprint "
                         f"{fingerprint}) as {first_source}'s {name!r}: its rows are labelled {name!r}")
    runs, repeats = merge_runs([document.runs for document, _ in group], [source for _, source in group])
    notes.extend(repeat_note(repeat, name) for repeat in repeats)
    return replace(first, trace=replace(first.trace, fingerprint=fingerprint), runs=tuple(runs)), first_source


def repeat_note(repeat: Repeat, trace: str) -> str:
    """One line on the runs of a file counted once, naming the files that held them first."""
    earlier = ", ".join("runs before them in the same file" if s == repeat.source else s for s in repeat.earlier)
    if repeat.runs == repeat.total and not repeat.differ:
        return f"{repeat.source} duplicates {earlier} (trace {trace!r}: the same {repeat.total} runs): counted once"
    note = (f"{repeat.source}: {repeat.runs} of its {repeat.total} runs repeat {earlier} (trace {trace!r}, same counts): "
            "counted once")
    if repeat.differ:
        note += (f"; {repeat.differ} of them record other bytes, modeled seconds or tier counters "
                 "(as under another layout or hardware), which gaps.md does not show")
    return note


def _named_apart(merged: list[tuple[ResultsDocument, str]], notes: list[str]) -> list[ResultsDocument]:
    """The documents, those of traces that share a name with another trace renamed ``name
    (fingerprint)``; appends a note for each such name."""
    by_name: dict[str, list[tuple[ResultsDocument, str]]] = defaultdict(list)
    for document, source in merged:
        by_name[document.trace.name].append((document, source))
    for name, group in by_name.items():
        if len(group) > 1:
            sources = ", ".join(source for _, source in group)
            notes.append(f"{sources} hold different traces (fingerprints) named {name!r}: rows name each by its fingerprint")
            if len({legacy_fingerprint(document.trace.fingerprint) for document, _ in group}) > 1:
                notes.append(f"{sources}: some were written before trace fingerprints became xxh3-128, so one trace may be "
                             "listed twice; re-run the older ones to tell")
    digits = {name: _distinct_digits([d.trace.fingerprint for d, _ in group]) for name, group in by_name.items()}
    return [replace(d, trace=replace(d.trace, name=f"{d.trace.name} ({_short(d.trace.fingerprint, digits[d.trace.name])})"))
            if len(by_name[d.trace.name]) > 1 else d for d, _ in merged]


def _distinct_digits(fingerprints: list[str]) -> int:
    """The fewest digits, at least ``_SHORT_DIGITS``, whose short labels tell ``fingerprints``
    (distinct) apart; every digit when none fewer do."""
    for digits in range(_SHORT_DIGITS, 32):
        if len({_short(f, digits) for f in fingerprints}) == len(fingerprints):
            return digits
    return 32


def _short(fingerprint: str, digits: int = _SHORT_DIGITS) -> str:
    """The fingerprint's algorithm and first ``digits`` hex digits (``xxh3-128:8bb14f47022a``;
    older files: ``blake2b:...``)."""
    if legacy_fingerprint(fingerprint):
        return "blake2b:" + fingerprint[:digits]
    return fingerprint[:len(FINGERPRINT_PREFIX) + digits]


def gap_rows(document: ResultsDocument, candidates: frozenset[str] | None = None) -> list[GapRow]:
    """The best online policy in each cache (tier layout) of one results document, among the
    runs labelled as in ``candidates`` where given (``best_per_capacity``)."""
    return [_row(document.trace.name, entry) for entry in best_per_capacity(list(document.runs), candidates)]


def gap_notes(document: ResultsDocument, candidates: frozenset[str] | None = None) -> list[str]:
    """One sentence per reason some rows of one document's gap table have no gap closed (``n/a``):
    decode runs with a prefetch policy, or one not recorded; one plain reference of the two
    beside runs made otherwise (``half_references``); no references at all (``unreferenced_runs``,
    report.md's sentence); one plain reference of the two beside plain runs only; or LRU missing
    no more than Belady. Invariant: every row of ``gap_rows(document, candidates)`` whose best
    has no gap closed is explained by one of them."""
    best = best_per_capacity(list(document.runs), candidates)
    plain = [b for b in best if b.best.prefetch == "none" and not b.half_referenced]
    sentences = (unreferenced_prefetch(best), half_references(sum(b.half_referenced for b in best)),
                 unreferenced_runs([(b.best, b.lru, b.belady) for b in plain]), *_one_reference(plain), _no_gap(plain))
    return [f"trace {document.trace.name!r}: {sentence}" for sentence in sentences if sentence is not None]


def _caches(best: list[CapacityBest]) -> str:
    """``prefix single HBM 500, object single HBM 1,000``: the caches of ``best`` by name."""
    return ", ".join(f"{b.semantics.value} {b.mode.value} {tiers_text(b.best)}" for b in best)


def _one_reference(best: list[CapacityBest]) -> list[str]:
    """A sentence for the caches of ``best`` holding a plain ``lru`` run and no ``belady`` run,
    and one for the reverse: no gap closed there, and what to replay."""
    only_lru = [b for b in best if b.lru is not None and b.belady is None]
    only_belady = [b for b in best if b.lru is None and b.belady is not None]
    return [f"no gap closed in {_caches(caches)}: {'it holds' if len(caches) == 1 else 'each holds'} a plain {have} run "
            f"and no {lacking} run of the same cache; replay {BASELINE} and {BELADY} over the same --capacity or --tiers "
            "for a gap" for caches, have, lacking in ((only_lru, BASELINE, BELADY), (only_belady, BELADY, BASELINE)) if caches]


def _no_gap(best: list[CapacityBest]) -> str | None:
    """A sentence for the caches of ``best`` whose LRU misses no more than their Belady (no gap
    to close: as at a capacity that holds every block, where every miss is a first use)."""
    caches = [b for b in best if b.lru is not None and b.belady is not None and b.gap_closed is None]
    if not caches:
        return None
    return (f"no gap closed in {_caches(caches)}: {BASELINE} misses no more than {BELADY} there (as where the cache "
            "holds every block and every miss is a first use), so there is no gap to close")


def left_out(document: ResultsDocument, sources: list[str]) -> str | None:
    """A sentence on what of one document gaps.md has no row for, naming the trace and its files:
    the whole trace when no cache of it holds a one-engine run of an online policy (only Belady,
    or fleet runs), else its caches that hold only offline runs; None when every cache has a row.
    """
    single = [r for r in document.runs if not r.is_fleet]
    where = f"trace {document.trace.name!r} ({', '.join(sources)})"
    if not best_per_capacity(single):
        policies = ", ".join(dict.fromkeys(r.label + (" (fleet)" if r.is_fleet else "") for r in document.runs))
        return (f"{where}: no row: none of its {len(document.runs)} runs ({policies}) is a one-engine run of an online "
                "policy, which a best online policy needs")
    offline_only = [group for group in by_layout(single).values() if all(is_offline(r) for r in group)]
    if not offline_only:
        return None
    caches = ", ".join(f"{g[0].semantics.value} {g[0].mode.value} {tiers_text(g[0])}" for g in offline_only)
    policies = ", ".join(dict.fromkeys(r.label for g in offline_only for r in g))
    return (f"{where}: no row for {len(offline_only)} of its caches ({caches}): they hold only offline runs ({policies}), "
            "no online policy")


def tuned_winners(tune: ResultsDocument, candidates: frozenset[str] | None = None) -> dict[tuple, str]:
    """The online policy that won each cache, (semantics, mode, tier layout) -> its label, of
    ``tune`` (the first half of a split): the policy a split report measures on the second.
    Only runs labelled as in ``candidates`` (where given: the split's ``--policy`` runs, not
    the plain ``lru`` it adds as a reference) compete."""
    return {_cache(e): e.best.label for e in best_per_capacity(list(tune.runs), candidates)}


def tuned_run(entry: CapacityBest, runs: tuple[Run, ...] | list[Run],
              winners: dict[tuple, str]) -> tuple[str | None, Run | None]:
    """The policy tuned for ``entry``'s cache (``tuned_winners``; None when the first half had
    no online run there) and its one-engine run of that cache among ``runs`` (None when none)."""
    label = winners.get(_cache(entry))
    run = next((r for r in runs if not r.is_fleet and r.label == label
                and (r.semantics, r.mode, tier_layout(r)) == _cache(entry)), None)
    return label, run


def split_rows(tune: ResultsDocument, test: ResultsDocument, candidates: frozenset[str] | None = None) -> list[GapRow]:
    """Rows of ``test`` (the reported half) with the winner picked on ``tune`` (the first half)
    over the same (semantics, mode, tier layout); the tuned and the hindsight winner are picked
    among the same runs (``candidates``, where given)."""
    winners = tuned_winners(tune, candidates)
    rows = []
    for entry in best_per_capacity(list(test.runs), candidates):
        label, run = tuned_run(entry, test.runs, winners)
        rows.append(_row(test.trace.name, entry, tuned=label, tuned_miss=run.miss_ratio if run else None,
                         tuned_gap=gap_closed(run, entry.lru, entry.belady) if run else None))
    return rows


def tuned_notes(rows: list[GapRow], split_traces: set[str]) -> list[str]:
    """Sentences under a table with split columns: the caches of a split's second half
    (``split_traces``) where no policy was tuned or the tuned one has no run, and the rows of
    other traces, which have no tuned pick and whose best is their own hindsight winner; none
    without split columns."""
    if not any(r.tuned is not None for r in rows):
        return []
    notes = []
    for trace in dict.fromkeys(r.trace for r in rows if r.trace in split_traces):
        untuned = sum(r.trace == trace and r.tuned is None for r in rows)
        unrun = sum(r.trace == trace and r.tuned is not None and r.tuned_miss is None for r in rows)
        if untuned:
            notes.append(f"trace {trace!r}: no policy was tuned on the first half in {untuned} of its caches (its "
                         "first half holds no run of the compared policies there): n/a")
        if unrun:
            notes.append(f"trace {trace!r}: in {unrun} of its caches the policy tuned on the first half has no run on "
                         "the second half: its miss and gap closed read n/a")
    others = list(dict.fromkeys(r.trace for r in rows if r.trace not in split_traces))
    if others:
        one = len(others) == 1
        notes.append(f"trace{'' if one else 's'} {', '.join(map(repr, others))}: no policy tuned on a first half (n/a): "
                     f"{'it is' if one else 'they are'} not the second half of a split given with its first half, so "
                     "the best in hindsight is the best online policy on the trace itself, picked after it was run")
    return notes


def escape_table_text(text: str) -> str:
    """Text of gaps.md and split.md: ``escape_markdown``'s, underscores inside words kept."""
    return escape_markdown(text, keep_intraword_underscores=True)


def _cell(value: float | None, how) -> str:
    return "n/a" if value is None else how(value)


def _beats_belady(row: GapRow) -> bool:
    """Whether the row's best (or tuned) policy misses less than the plain belady run of its
    cache (beating a Belady made with an admission filter or placement is ``OWN_NOT_BOUND``'s)."""
    misses = [row.best_miss] + ([row.tuned_miss] if row.tuned_miss is not None else [])
    return row.belady is not None and row.references is None and min(misses) < row.belady


#: The split table's columns after the cache's: the policy tuned on the first half and the
#: hindsight winner of the second, each with its figures on the second half.
SPLIT_HEADER = ("tuned on 1st half", "tuned miss", "tuned gap closed", "best in hindsight", "best gap closed")


def _row_cells(r: GapRow, split: bool) -> list[str]:
    """One row's cells of ``gap_markdown`` (the split columns where ``split``); the references
    labelled where they are not the plain runs, and a gap above 100% naming the Belady run beaten."""
    lru, belady = (f" ({label})" for label in r.references) if r.references else ("", "")
    gap = partial(gap_text, reference=r.references[1] if r.references else BELADY)
    cells = [r.trace, r.semantics, r.mode, fmt.integer(r.capacity_blocks), r.tiers, _cell(r.lru, fmt.ratio) + lru,
             _cell(r.belady, fmt.ratio) + belady]
    if split:
        return cells + [r.tuned or "n/a", _cell(r.tuned_miss, fmt.ratio), _cell(r.tuned_gap, gap), r.best,
                        _cell(r.best_gap, gap)]
    return cells + [r.best, fmt.ratio(r.best_miss), _cell(r.best_gap, gap)]


def gap_markdown(rows: list[GapRow], missing: list[str] | tuple[str, ...] = (),
                 notes: list[str] | tuple[str, ...] = ()) -> str:
    """A Markdown table of ``rows`` (split columns when any row has a tuned policy), with a note
    under it where a policy missed less than Belady's replay (a gap closed above 100%, shown as is),
    one line per sentence of ``notes`` (why a cell reads n/a: ``gap_notes``, ``tuned_notes``, a
    second half without its first: ``halves.pair_halves``) and of ``missing`` (what has no row,
    as ``left_out`` says).

    Every cell is escaped as report.md escapes text (``escape_markdown``; an underscore inside a
    word, which Markdown never reads as emphasis, stays as typed, since the table is printed
    too): a trace named ``a_*b*`` or ``<b>`` shows as named, never as emphasis, HTML, code or a link."""
    split = any(r.tuned is not None for r in rows)
    header = ["trace", "semantics", "mode", "capacity", "tiers (blocks)", "LRU miss", "Belady miss"]
    header += list(SPLIT_HEADER) if split else ["best online policy", "its miss", "gap closed"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join(escape_table_text(cell) for cell in _row_cells(r, split)) + " |")
    if any(_beats_belady(r) for r in rows):
        lines.append(f"\nNote: {BEYOND_BELADY}.")
    if any(r.references for r in rows):
        lines.append(f"\nNote: {OWN_REFERENCES}, labelled so in the LRU and Belady columns. "
                     f"{OWN_NOT_BOUND[0].upper()}{OWN_NOT_BOUND[1:]}.")
    if notes:
        lines.append("\nNotes:\n" + "\n".join(f"- {escape_table_text(sentence)}." for sentence in notes))
    if missing:
        lines.append("\nNot in this table:\n" + "\n".join(f"- {escape_table_text(sentence)}" for sentence in missing))
    return "\n".join(lines) + "\n"
