"""Gap-closed tables across traces and across the halves of one trace.

Each row is one (trace, semantics, mode, tier layout): LRU's and Belady's miss ratios over
those tiers, the best online policy there (named) and the share of the LRU-to-Belady gap it
closes. Two hierarchies of one total capacity are two rows, each against its own LRU and Belady. A split table
adds what a comparison that cannot be fooled by hindsight reports: the winner picked on the
first half of a trace and the gap it closes on the second half.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..results import ResultsDocument
from . import fmt
from .summary import CapacityBest, best_per_capacity, gap_closed, tier_layout
from .tables import tiers_text

__all__ = ["GapRow", "gap_rows", "split_rows", "gap_markdown"]


@dataclass(frozen=True)
class GapRow:
    """One cache (tier layout) of one trace; ``tiers`` names it (``HBM 5 + DRAM 35``).

    ``tuned`` (split tables only) is the policy that won on the first half; ``tuned_miss`` and
    ``tuned_gap`` are its figures on the reported half (None when it did not run there).
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


def _cache(entry: CapacityBest) -> tuple:
    """What identifies the cache of an entry: (semantics, mode, tier layout)."""
    return entry.semantics, entry.mode, tier_layout(entry.best)


def _row(trace: str, entry: CapacityBest, **tuned) -> GapRow:
    return GapRow(trace, entry.semantics.value, entry.mode.value, entry.capacity_blocks, tiers_text(entry.best),
                  entry.lru.miss_ratio if entry.lru else None, entry.belady.miss_ratio if entry.belady else None,
                  entry.best.label, entry.best.miss_ratio, entry.gap_closed, **tuned)


def gap_rows(document: ResultsDocument) -> list[GapRow]:
    """The best online policy in each cache (tier layout) of one results document."""
    return [_row(document.trace.name, entry) for entry in best_per_capacity(list(document.runs))]


def split_rows(tune: ResultsDocument, test: ResultsDocument) -> list[GapRow]:
    """Rows of ``test`` (the reported half) with the winner picked on ``tune`` (the first half)
    over the same (semantics, mode, tier layout)."""
    winners = {_cache(e): e.best.label for e in best_per_capacity(list(tune.runs))}
    rows = []
    for entry in best_per_capacity(list(test.runs)):
        label = winners.get(_cache(entry))
        run = next((r for r in test.runs if not r.is_fleet and r.label == label
                    and (r.semantics, r.mode, tier_layout(r)) == _cache(entry)), None)
        rows.append(_row(test.trace.name, entry, tuned=label, tuned_miss=run.miss_ratio if run else None,
                         tuned_gap=gap_closed(run, entry.lru, entry.belady) if run else None))
    return rows


def _cell(value: float | None, how) -> str:
    return "n/a" if value is None else how(value)


def gap_markdown(rows: list[GapRow]) -> str:
    """A Markdown table of ``rows`` (split columns when any row has a tuned policy)."""
    split = any(r.tuned is not None for r in rows)
    header = ["trace", "semantics", "mode", "capacity", "tiers (blocks)", "LRU miss", "Belady miss"]
    header += ["tuned on 1st half", "its miss", "its gap closed", "best in hindsight", "its gap closed"] if split else \
        ["best online policy", "its miss", "gap closed"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r.trace, r.semantics, r.mode, fmt.integer(r.capacity_blocks), r.tiers, _cell(r.lru, fmt.ratio),
                 _cell(r.belady, fmt.ratio)]
        if split:
            cells += [r.tuned or "n/a", _cell(r.tuned_miss, fmt.ratio), _cell(r.tuned_gap, fmt.percent), r.best,
                      _cell(r.best_gap, fmt.percent)]
        else:
            cells += [r.best, fmt.ratio(r.best_miss), _cell(r.best_gap, fmt.percent)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
