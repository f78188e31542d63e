"""Tables of a report (formatted for reading) and the rows of ``results.csv`` (exact values).

Columns appear only when some run has the data (tier hits for hierarchies, bytes and time
with a layout, prefill savings for prefix semantics), so a plain sweep stays narrow.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from typing import Callable

from ..config import REMOTE_TIER, TIER_NAMES, Semantics, TraceKind
from ..results import LayoutInfo, TierRecord
from . import fmt
from .document import Table
from .fleet import write_text
from .model import ReportData, Run, per_layer_block
from .summary import (BASELINE, BELADY, BEYOND_BELADY, CapacityBest, beats_plain_belady, gap_closed, gap_text, gaps_for,
                      half_references, is_offline, is_plain, layouts_need_naming, own_references, run_references)

__all__ = ["MODELED_TIME", "PREFETCHED", "unreferenced_runs", "runs_table", "tier_table", "tiers_text", "codec_sentences", "best_table", "split_best_table",
           "trace_table", "results_csv"]

#: What a run's "modeled time" (``modeled_seconds.total``) counts.
MODELED_TIME = ("Modeled time is the recompute time of the misses plus every transfer between tiers, background "
                "write-backs and demotions included, counted serially.")
#: What a decode run's "prefetched (used / wasted)" counts.
PREFETCHED = ("Prefetched (used / wasted): blocks the run's prefetch policy moved up, those a later read found where "
              "the prefetch put them, and those pushed back down or out before any read (the rest were in place, "
              "unread, at the end).")
# The hit split of item 13 (schema 3): None in files of older schemas, bytes without a layout,
# seconds without hardware.
_SPLIT_FIELDS = ("hits_in_place", "hits_promoted", "in_place_bytes", "promoted_bytes", "in_place_seconds", "promoted_seconds")
# Tier names in column order (the shared remote tier of a fleet replay last).
_TIERS = TIER_NAMES + (REMOTE_TIER,)
_CSV_PREFETCH = ("prefetched", "prefetch_used", "prefetch_wasted")
_CSV_TIER_FIELDS = ("capacity_blocks", "codec", "block_bytes", "hits", "evictions", "demotions", "promotions") + _SPLIT_FIELDS


@dataclass(frozen=True)
class _Column:
    header: str
    numeric: bool
    cell: Callable[[Run, str], str]  # (the run, its gap closed cell: ``_gap_cell``)


def tiers_text(run: Run) -> str:
    """A run's tiers and capacities, with any codec: ``HBM 2,000 + DRAM 8,000 + NVMe 32,000 INT4``."""
    return " + ".join(f"{fmt.tier(t.name)} {fmt.integer(t.capacity_blocks)}{fmt.codec_suffix(t.codec)}" for t in run.tiers) or "–"


def codec_sentences(runs: list[Run], layout: LayoutInfo | None) -> list[str]:
    """One sentence per quantised (tier, codec) of ``runs``: what a block costs there and how
    many more blocks the same bytes hold than unquantised KV (needs a layout)."""
    seen = {(t.name, t.codec, t.block_bytes) for r in runs for t in r.tiers if t.codec != "none" and t.block_bytes}
    if layout is None:
        return []
    return [f"{fmt.tier(name)} with {codec.upper()} stores a block in {fmt.size(nbytes)} instead of "
            f"{fmt.size(layout.block_bytes)} (scales included): the same bytes hold "
            f"{layout.block_bytes / nbytes:.1f}× the blocks of unquantised KV."
            for name, codec, nbytes in sorted(seen)]


def _base_columns() -> list[_Column]:
    return [
        _Column("policy", False, lambda r, g: r.label),
        _Column("semantics", False, lambda r, g: r.semantics.value),
        _Column("hierarchy", False, lambda r, g: r.mode.value),
        _Column("capacity (blocks)", True, lambda r, g: fmt.integer(r.capacity_blocks)),
        _Column("tiers (blocks)", False, lambda r, g: tiers_text(r) + _fleet_text(r)),
        _Column("accesses", True, lambda r, g: fmt.integer(r.accesses)),
        _Column("hits", True, lambda r, g: fmt.integer(r.hits)),
        _Column("misses", True, lambda r, g: fmt.integer(r.misses)),
        _Column("miss ratio", True, lambda r, g: fmt.ratio(r.miss_ratio)),
        _Column("gap closed", True, lambda r, g: g),
    ]


def _fleet_text(run: Run) -> str:
    """``, 4 instances (round_robin, write back)`` for a fleet run (private tiers are each
    instance's; the write mode where it has a shared tier)."""
    return f", {len(run.instances)} instances ({run.route.value}{write_text(run, ', ')})" if run.is_fleet else ""


def _tier_columns(runs: tuple[Run, ...]) -> list[_Column]:
    if not any(r.is_hierarchy for r in runs):
        return []
    present = [n for n in _TIERS if any(t.name == n for r in runs for t in r.tiers)]
    return [_Column(f"{fmt.tier(n)} hits", True, lambda r, g, n=n: fmt.integer(sum(t.hits for t in r.tiers if t.name == n)))
            for n in present]


def _prefetch_columns(runs: tuple[Run, ...]) -> list[_Column]:
    """What the prefetch policy of each decode run did, where some run had one."""
    if not any(r.prefetch not in (None, "none") for r in runs):
        return []
    return [_Column("prefetched (used / wasted)", True, lambda r, g: _prefetch_text(r))]


def _prefetch_text(run: Run) -> str:
    """``33 (11 / 14)``: blocks moved up by the run's prefetches, those a later read found
    there, those pushed down or out unread; "not recorded" for a decode run of a file without
    them, a dash outside decode semantics."""
    if run.prefetched is None:
        return "not recorded" if run.semantics is Semantics.DECODE else "–"
    return f"{fmt.integer(run.prefetched)} ({fmt.integer(run.prefetch_used)} / {fmt.integer(run.prefetch_wasted)})"


def _cost_columns(runs: tuple[Run, ...]) -> list[_Column]:
    columns = []
    if any(r.bytes_moved for r in runs):
        columns.append(_Column("bytes moved", True, lambda r, g: fmt.size(sum(r.bytes_moved.values()))))
    if any(r.modeled_seconds for r in runs):
        columns.append(_Column("modeled time", True, lambda r, g: fmt.optional(r.modeled_seconds.get("total"), fmt.seconds)))
    if any(r.prefill_tokens_saved is not None for r in runs):
        columns.append(_Column("prefill tokens saved", True, lambda r, g: fmt.optional(r.prefill_tokens_saved, fmt.integer)))
    if any(r.ttft_saved_s is not None for r in runs):
        columns.append(_Column("TTFT saved", True, lambda r, g: fmt.optional(r.ttft_saved_s, fmt.seconds)))
    columns.append(_Column("replay wall time", True, lambda r, g: fmt.optional(r.wall_seconds, fmt.seconds)))
    return columns


def runs_table(data: ReportData) -> Table:
    """Every run with its exact counts (the CSV has the same numbers unrounded)."""
    prefetch = _prefetch_columns(data.runs)
    columns = _base_columns() + _tier_columns(data.runs) + prefetch + _cost_columns(data.runs)
    refs = run_references(list(data.runs))
    gaps = gaps_for(list(data.runs))
    rows = tuple(tuple(c.cell(run, _gap_cell(gaps[run.key], refs[run.key][1])) for c in columns) for run in data.runs)
    timed = f" {MODELED_TIME}" if any(r.modeled_seconds for r in data.runs) else ""
    beyond = any(gaps[run.key] is not None and beats_plain_belady(run, refs[run.key][1]) for run in data.runs)
    notes = (BEYOND_BELADY if beyond else None, own_references(refs.values()), half_references(list(data.runs)),
             unreferenced_runs([(run, *refs[run.key]) for run in data.runs]))
    noted = "".join(f" {_sentence(text)}" for text in notes if text)
    moved = f" {PREFETCHED}" if prefetch else ""
    return Table(tuple(c.header for c in columns), rows, tuple(c.numeric for c in columns),
                 caption="All runs. Gap closed = (miss LRU − miss policy) / (miss LRU − miss Belady) over the same tiers "
                         f"(the same capacity of each tier, not only the same total).{noted}{moved}{timed}")


def _gap_cell(gap: float | None, belady: Run | None) -> str:
    """A gap closed (``gap_text``; "–" where None), naming ``belady``, the Belady run it was
    measured against, where the run beat it (``(beats belady+tinylfu)``)."""
    return fmt.optional(gap, lambda value: gap_text(value, belady.label if belady is not None else BELADY))


#: Labels an ``unreferenced_runs`` sentence names before it counts the rest.
_NAMED_UNREFERENCED = 6


def unreferenced_runs(runs: list[tuple[Run, Run | None, Run | None]]) -> str | None:
    """A sentence (no full stop) on the online one-engine runs without a prefetch policy, given
    as (run, its lru reference, its belady reference), that have no gap closed because their
    cache holds no references at all: neither plain ``lru`` and ``belady`` runs nor the two made
    with the run's own admission and placement (``summary.references``); None when there are none.

    A run with one reference of two is ``half_references``'s, a prefetching decode run
    ``unreferenced_prefetch``'s and a fleet run has no gap by design: none is counted here.
    """
    labels = sorted({run.label for run, lru, belady in runs
                     if lru is None and belady is None and not run.is_fleet and run.prefetch == "none"
                     and not is_offline(run)})
    if not labels:
        return None
    shown = labels[:_NAMED_UNREFERENCED] + ([f"{len(labels) - _NAMED_UNREFERENCED} more"]
                                            if len(labels) > _NAMED_UNREFERENCED else [])
    named = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"
    return (f"no gap closed for {named}: these results hold no {BASELINE} and {BELADY} runs of the same cache (the same "
            f"capacity or tiers, semantics and mode), neither plain ones nor ones made with the same admission and "
            f"placement; replay {BASELINE} and {BELADY} over the same --capacity or --tiers for a gap")


def _sentence(text: str) -> str:
    """``text`` as a sentence: capitalised, with a full stop."""
    return f"{text[0].upper()}{text[1:]}."


def tier_table(runs: list[Run]) -> Table:
    """One row per tier of each hierarchy run: its hits, read in place or promoted to the top tier.

    A hit in a lower tier is either read where it lies (charged on its link to HBM) or
    promoted (moved up, charged the same way); the top tier's hits are all in place and free.
    Values a results file did not record read "not recorded".
    """
    header = ("policy", "semantics", "hierarchy", "tier", "capacity (blocks)", "hits", "read in place", "promoted",
              "in-place bytes", "promoted bytes", "in-place time", "promoted time")
    rows = tuple(_tier_row(run, tier) for run in runs for tier in run.tiers)
    return Table(header, rows, (False, False, False, False) + (True,) * 8,
                 caption="Per-tier hits of every hierarchy run. 'not recorded': the results file does not hold the "
                         "figure (written before results schema 3, or bytes without --model, times without --hardware).")


def _tier_row(run: Run, tier: TierRecord) -> tuple[str, ...]:
    return (run.label, run.semantics.value, run.mode.value, fmt.tier(tier.name), fmt.integer(tier.capacity_blocks),
            fmt.integer(tier.hits), _count(tier.hits_in_place), _count(tier.hits_promoted),
            fmt.recorded(tier.in_place_bytes, fmt.size), fmt.recorded(tier.promoted_bytes, fmt.size),
            fmt.recorded(tier.in_place_seconds, fmt.seconds), fmt.recorded(tier.promoted_seconds, fmt.seconds))


def _count(value: int | None) -> str:
    return fmt.recorded(value, fmt.integer)


def best_table(best: list[CapacityBest]) -> Table:
    """The best online policy in each cache, against LRU and Belady over the same tiers.

    A "tiers (blocks)" column names each cache where capacity alone does not
    (``layouts_need_naming``): hierarchies of one total are different rows.
    """
    named = layouts_need_naming([b.best for b in best])
    header = _cache_header(named) + (
        "best online policy", "its miss ratio", f"{BASELINE} miss ratio", f"{BELADY} miss ratio", "gap closed")
    rows = tuple(_cache_cells(b, named) + (b.best.label, _ratio(b.best.miss_ratio)) + _reference_cells(b)
                 + (_gap_cell(b.gap_closed, b.belady),) for b in best)
    return Table(header, rows, (False, False, True) + ((False,) if named else ()) + (False, True, True, True, True),
                 caption=_best_caption(best, any(beats_plain_belady(b.best, b.belady) for b in best)))


def split_best_table(best: list[CapacityBest], tuned: list[tuple[str | None, Run | None]]) -> Table:
    """``best_table`` of a split report (of the second half), with split.md's columns: in each
    cache the policy tuned on the first half (``tuned``, one (label, its run here) per entry of
    ``best``, in order) and its figures, then the best in hindsight, the winner of this half itself."""
    named = layouts_need_naming([b.best for b in best])
    header = _cache_header(named) + ("tuned on 1st half", "its miss ratio", f"{BASELINE} miss ratio",
                                     f"{BELADY} miss ratio", "gap closed", "best in hindsight", "hindsight miss ratio",
                                     "hindsight gap closed")
    rows = tuple(_cache_cells(b, named) + (label or "–", fmt.optional(run and run.miss_ratio, _ratio))
                 + _reference_cells(b) + (_gap_cell(run and gap_closed(run, b.lru, b.belady), b.belady),
                                          b.best.label, _ratio(b.best.miss_ratio), _gap_cell(b.gap_closed, b.belady))
                 for b, (label, run) in zip(best, tuned))
    beyond = any(beats_plain_belady(b.best, b.belady) or beats_plain_belady(run, b.belady) for b, (_, run) in zip(best, tuned))
    return Table(header, rows, (False, False, True) + ((False,) if named else ()) + (False, True, True, True, True, False,
                 True, True), caption=_best_caption(best, beyond))


def _best_caption(best: list[CapacityBest], beyond: bool) -> str:
    """Notes under a best-policy table: what a gap closed above the plain belady's 100% means
    (where one is), which references are not the plain lru and belady runs and that such a
    Belady is no bound (``own_references``), and why a cache with one plain reference of the
    two has no gap (``half_references``)."""
    own = own_references((b.lru, b.belady) for b in best)
    half = half_references(sum(b.half_referenced for b in best))
    none = unreferenced_runs([(b.best, b.lru, b.belady) for b in best])
    return " ".join(_sentence(text) for text in (BEYOND_BELADY if beyond else None, own, half, none) if text)


def _cache_header(named: bool) -> tuple[str, ...]:
    """The columns that name a cache (its tiers too where ``named``: ``layouts_need_naming``)."""
    return ("semantics", "hierarchy", "capacity (blocks)") + (("tiers (blocks)",) if named else ())


def _cache_cells(best: CapacityBest, named: bool) -> tuple[str, ...]:
    return (best.semantics.value, best.mode.value, fmt.integer(best.capacity_blocks)) + (
        (tiers_text(best.best),) if named else ())


def _reference_cells(best: CapacityBest) -> tuple[str, str]:
    """LRU's and Belady's miss ratios of the cache ("–" where not run), each with its label where
    it is not the plain run (``99.87% (lru+tinylfu)``: ``summary.references``)."""
    return tuple(fmt.optional(ref and ref.miss_ratio, _ratio) + ("" if ref is None or is_plain(ref) else f" ({ref.label})")
                 for ref in (best.lru, best.belady))


def _ratio(value: float) -> str:
    return fmt.percent(value, 2)


def trace_table(data: ReportData) -> Table:
    """The trace's statistics and the presets the costs were modeled with."""
    trace = data.trace
    steps = trace.kind is TraceKind.STEPS
    rows = [
        ("trace", f"{trace.name} ({'step' if steps else 'request'} trace)"),
        ("step records" if steps else "requests", fmt.integer(trace.requests)),
        ("block reads and writes" if steps else "block accesses", fmt.integer(trace.accesses)),
        ("distinct blocks", fmt.integer(trace.unique_blocks)),
    ]
    if not steps:  # a step trace's writes store new blocks: first accesses are not misses there
        rows.append(("compulsory-miss floor", f"{fmt.percent(trace.compulsory_miss_ratio, 2)} (distinct blocks / accesses)"))
    rows.append(("fingerprint", trace.fingerprint))
    rows += _preset_rows(data)
    return Table(("", ""), tuple(rows), (False, False))


def _kv_scope(layout: LayoutInfo) -> str:
    """Whose KV one block holds, read from the recorded bytes: one layer's (a step trace's
    per-layer blocks) or every layer's (a request trace's, and step traces replayed before
    blocks were charged per layer: ``model.per_layer_block``)."""
    return "one layer's KV" if per_layer_block(layout) else "KV (every layer)"


def _stale_step_block(data: ReportData) -> str | None:
    """The note on a step trace's file whose block holds every layer's KV (written before a
    step trace's block, one layer's KV, was charged one layer's bytes), or None."""
    layout = data.layout
    if data.trace.kind is not TraceKind.STEPS or layout is None or layout.layers <= 1 or per_layer_block(layout):
        return None
    return (f"stale: a step trace's block is one layer's KV, but these results (written before step-trace blocks were "
            f"charged one layer's bytes) charged each block every layer's, so their bytes and modeled seconds are "
            f"{fmt.integer(layout.layers)}x (the layer count) too high, and a capacity given as a size held that many "
            f"times too few blocks; re-run the replay")


def _preset_rows(data: ReportData) -> list[tuple[str, str]]:
    layout, rows = data.layout, []
    if layout:
        block = f"{fmt.integer(layout.block_tokens)} tokens = {fmt.size(layout.block_bytes)} of {_kv_scope(layout)}"
        rows += [("model (KV layout)", layout.name), ("one block", block)]
        stale = _stale_step_block(data)
        if stale:
            rows.append(("note", stale))
    else:
        rows.append(("model (KV layout)", "none given: capacities in blocks only, no bytes"))
    rows.append(("hardware (link model)", data.hardware or "none given: no bytes or times modeled"))
    return rows


def _csv_header(data: ReportData) -> list[str]:
    tiers = [n for n in _TIERS if any(t.name == n for r in data.runs for t in r.tiers)]
    links = sorted({k for r in data.runs for k in r.bytes_moved})
    parts = sorted({k for r in data.runs for k in r.modeled_seconds})
    header = ["policy", "admission", "placement", "prefetch", "semantics", "mode", "capacity_blocks", "accesses", "hits", "misses",
              "miss_ratio", "hit_ratio", "gap_closed", "gap_references"]
    if any(r.prefetched is not None for r in data.runs):
        header += list(_CSV_PREFETCH)
    if any(r.is_fleet for r in data.runs):
        header += ["instances", "route", "shared_writes", "remote_write", "write_hits"]
    header += [f"{n}_{field}" for n in tiers for field in _CSV_TIER_FIELDS]
    header += [f"bytes_{link}" for link in links] + [f"seconds_{part}" for part in parts]
    return header + ["prefill_tokens", "prefill_tokens_saved", "ttft_saved_s", "wall_seconds"]


def _csv_row(run: Run, gap: float | None, refs: tuple[Run | None, Run | None]) -> dict[str, object]:
    """One run's ``results.csv`` row; ``gap_references`` names the two runs its gap closed was
    measured against (``lru vs belady``, ``lru+tinylfu vs belady+tinylfu``), empty without a gap."""
    lru, belady = refs
    row: dict[str, object] = {
        "policy": run.policy, "admission": run.admission, "placement": run.placement, "prefetch": run.prefetch,
        "semantics": run.semantics.value, "mode": run.mode.value,
        "capacity_blocks": run.capacity_blocks, "accesses": run.accesses, "hits": run.hits, "misses": run.misses,
        "miss_ratio": run.miss_ratio, "hit_ratio": run.hit_ratio, "gap_closed": gap,
        "gap_references": None if gap is None else f"{lru.label} vs {belady.label}",
        "prefill_tokens": run.prefill_tokens, "prefill_tokens_saved": run.prefill_tokens_saved,
        "ttft_saved_s": run.ttft_saved_s, "wall_seconds": run.wall_seconds,
    }
    if run.prefetched is not None:
        row |= {key: getattr(run, key) for key in _CSV_PREFETCH}
    if run.is_fleet:
        row |= {"instances": len(run.instances), "route": run.route.value, "shared_writes": run.shared_writes,
                "remote_write": run.remote_write.value if run.remote_write else None, "write_hits": run.write_hits}
    for tier in run.tiers:
        for field in _CSV_TIER_FIELDS:
            row[f"{tier.name}_{field}"] = getattr(tier, field)
    row |= {f"bytes_{k}": v for k, v in run.bytes_moved.items()}
    return row | {f"seconds_{k}": v for k, v in run.modeled_seconds.items()}


def results_csv(data: ReportData) -> str:
    """``results.csv``: one row per run, values exactly as in the results documents.

    Floats are written with ``repr`` precision (Python's shortest round-trip form), so
    reading the CSV back gives the same numbers as ``tiercache replay``; an absent value
    is an empty cell.
    """
    refs = run_references(list(data.runs))
    gaps = gaps_for(list(data.runs))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=_csv_header(data), restval="", lineterminator="\n")
    writer.writeheader()
    for run in data.runs:
        writer.writerow({k: ("" if v is None else v) for k, v in _csv_row(run, gaps[run.key], refs[run.key]).items()})
    return out.getvalue()
