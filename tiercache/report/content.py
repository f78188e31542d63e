"""What the report says: one ``Document`` built from the merged runs.

Written for a reader who has never seen tiercache: the summary explains the terms before
the figures use them, every plot has a sentence saying what to look at, and the last
section gives the command that rebuilds the report.
"""

from __future__ import annotations

import re
from dataclasses import replace

from . import fmt, plots
from .across import tuned_run
from .document import Bullets, Code, Document, Image, Paragraph, Section
from .fleet import fleet_section
from .lru_curve import LRUCurve, dense_lru_curve
from ..results import Mode, Semantics, TraceKind
from ..results.hwinfo import LEGACY_PREFILL_MODEL
from ..sim.loader import Trace
from .model import ReportData, Run
from .summary import (BASELINE, BELADY, CapacityBest, Payoff, beats_belady, belady_caveat, belady_is_bound,
                      best_per_capacity, beyond_clause, by_group, gap_closed, hierarchy_payoffs, is_belady, is_offline,
                      layouts_need_naming, policy_labels, request_path_seconds, unreferenced_prefetch)
from .tables import best_table, codec_sentences, runs_table, split_best_table, tier_table, tiers_text, trace_table
from .ties import belady_advice, tie_finding, tie_note, tied_runs

__all__ = ["build_document"]

_SEMANTICS = {
    Semantics.OBJECT: "object semantics: every block access is an independent lookup (comparable one-to-one with libCacheSim)",
    Semantics.PREFIX: "prefix semantics: a request reuses only the longest cached prefix of its blocks; everything after "
              "the first miss is recomputed and stored again, as a serving engine's prefix cache does",
    Semantics.DECODE: "decode semantics: a long-sequence decode step trace; each step's reads are accesses and its "
              "writes are newly computed blocks",
}
# What "TTFT saved" counts, as sim/replay.py ``_prefix_figures`` computes it.
_TTFT_SAVED = ("prefill time of the saved tokens minus the modeled time of the loads (every transfer from a slower "
               "tier towards HBM, counted in full); write-backs and demotions run off the TTFT path and are not "
               "subtracted")
_REQUEST_TIME = ("the recompute time of the misses plus the loads (every transfer from a slower tier towards HBM, "
                 "counted in full); write-backs and demotions run in the background, each on its own link beside the "
                 "requests, and count only where one link is busy longer than that (the requests then wait for it)")
# What the payoff sentences compare, by ``Payoff.measure`` ("misses" needs no explanation).
_MEASURE_NOTES = {
    "ttft": f"Judged by modeled TTFT saved: {_TTFT_SAVED}.",
    "time": f"Judged by modeled request time: {_REQUEST_TIME}.",
}
_MODES = {
    Mode.SINGLE: "one tier",
    Mode.EXCLUSIVE: "exclusive hierarchy",
    Mode.WRITE_THROUGH: "write-through hierarchy",
}


def build_document(data: ReportData, trace: str | Trace | None, command: str,
                   tuned: dict[tuple, str] | None = None, candidates: frozenset[str] | None = None) -> Document:
    """The whole report.

    Args:
        data: the merged runs.
        trace: for the dense LRU curve, the trace file (or folder), or the trace itself (a split
            half, which no file holds); None uses the recorded path.
        command: the command line that rebuilds this report.
        tuned: in a split report (of the second half), the policy tuned on the first half per
            cache (``tuned_winners``): the summary leads with it, the hindsight winner beside it.
        candidates: the labels the best online policy is picked among (a split's ``--policy``
            runs, not the references it adds); None: every online run.
    """
    single = replace(data, runs=tuple(r for r in data.runs if not r.is_fleet))
    if single.runs:
        sections = _single_engine_sections(single, trace, tuned, candidates)
    else:  # fleet runs only: their own section says the rest
        sections = [Section("Summary", (Paragraph("The trace and the presets:"), trace_table(data)))]
    sections += [fleet_section(data.runs), Section("All runs", (runs_table(data),)), _reproduce(data, command)]
    labels = policy_labels(data.runs)
    runs, policies = len(data.runs), len(labels)
    subtitle = (f"{runs} replay run{'s' * (runs != 1)} of {policies} polic{'ies' if policies != 1 else 'y'} "
                f"({', '.join(labels)}) on one trace")
    return Document(f"Cache policy comparison: {data.trace.name}", subtitle, tuple(s for s in sections if s.blocks))


def _single_engine_sections(data: ReportData, trace: str | Trace | None, tuned: dict[tuple, str] | None,
                            candidates: frozenset[str] | None) -> list[Section]:
    """The sections over one-engine runs (fleet runs have their own section)."""
    colors = plots.policy_colors(data.runs)
    return [_summary(data, tuned, candidates, trace), _curves(data, colors, trace), _tiers(data, colors), _movement(data, colors),
            _prefix(data, colors)]


def _slug(kind: str, *members: Semantics | Mode) -> str:
    return "_".join([kind, *(re.sub(r"[^a-z0-9_]+", "-", m.value).strip("-") for m in members)])


def _group_title(semantics: Semantics, mode: Mode) -> str:
    return f"{semantics.value} semantics, {_MODES[mode]}"


def _summary(data: ReportData, tuned: dict[tuple, str] | None, candidates: frozenset[str] | None,
             trace: str | Trace | None) -> Section:
    steps = data.trace.kind is TraceKind.STEPS
    intro = (
        f"This report replays the {'step' if steps else 'request'} trace {data.trace.name} through a KV cache of several sizes, once per "
        "eviction policy, and counts how many block accesses miss. A KV block holds the attention keys and values "
        "of a run of prompt tokens; a hit means that block need not be recomputed (prefill) or fetched from a slower "
        "tier. Lower miss ratios are better."
    )
    floor = "" if steps else " The compulsory-miss floor counts first accesses, which miss at any capacity."
    bound = _bound(data.runs, belady_advice(data, trace)) + floor
    semantics = sorted({r.semantics for r in data.runs}, key=lambda s: s.value)
    blocks: list = [Paragraph(intro), Paragraph(bound)]
    blocks.append(Bullets(tuple(f"{_SEMANTICS[s]}." for s in semantics)))
    best = best_per_capacity(data.runs, candidates)
    picks = None if tuned is None else [tuned_run(b, data.runs, tuned) for b in best]
    ties = [tied_runs(b, data.runs, candidates) for b in best]  # caches the miss ratio cannot rank
    if best:
        named = layouts_need_naming([b.best for b in best])
        findings = [_finding(b, named, tied) for b, tied in zip(best, ties)] if picks is None else \
            [_split_finding(b, named, *pick) for b, pick in zip(best, picks)]
        blocks += [Paragraph("Key findings:"), Bullets(tuple(findings))]
    blocks += _payoff_blocks(hierarchy_payoffs(data.runs))
    blocks += [Paragraph("The trace and the presets:"), trace_table(data)]
    if best:
        blocks += _best_blocks(best, picks) + ([Paragraph(tie_note([b for b, t in zip(best, ties) if t]))] if any(ties) else [])
        caveat = unreferenced_prefetch(best)
        blocks += [Paragraph(caveat[0].upper() + caveat[1:] + ".")] if caveat else []
    return Section("Summary", tuple(blocks))


def _bound(runs: tuple[Run, ...], advice: str) -> str:
    """What the summary says of the bound: Belady's MIN and the gap closed where a belady run
    is in the results (``is_belady``), else that none is, with ``advice`` (``belady_advice``);
    any other policy that reads the future is named as a reference (``_references``); then the baseline."""
    if any(is_belady(r) for r in runs):
        head = (f"The policy {BELADY} (Belady's MIN) evicts the block needed furthest in the future. It must know the "
                f"future, so no serving system can run it{_belady_claim(runs)}")
        gap = (f" 'Gap closed' is (miss {BASELINE} − miss policy) / (miss {BASELINE} − miss {BELADY}): 0% is no better "
               f"than {BASELINE}, 100% is as good as {BELADY}.")
    else:
        head = (f"No run of {BELADY} (Belady's MIN) is in these results, so no bound is drawn and no gap closed is "
                f"measured{advice}.")
        gap = ""
    return f"{head}{_references(runs)} The policy {BASELINE} (least recently used) is the usual baseline.{gap}"


def _references(runs) -> str:
    """`` X reads the future, so no serving system can run it: an offline reference, not a
    bound.`` for the offline runs of ``runs`` that are not Belady's; empty if none."""
    others = _other_offline(runs)
    if not others:
        return ""
    one = len(others) == 1
    return (f" {_listed(others)} read{'s' if one else ''} the future, so no serving system can run "
            f"{'it: an offline reference, not a bound' if one else 'them: offline references, not bounds'}.")


def _other_offline(runs) -> list[str]:
    """Labels of the runs that read the future but are not Belady's (``is_belady``), in legend order."""
    others = {r.label for r in runs if is_offline(r) and not is_belady(r)}
    return [label for label in policy_labels(list(runs)) if label in others]


def _listed(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _belady_claim(runs: tuple[Run, ...]) -> str:
    """What the summary claims for Belady (ends a sentence): the bound where every run's cache
    is one (``belady_is_bound``), a reference beside the bound, or a reference only."""
    caveat = belady_caveat(list(runs))
    if caveat is None:
        return ", but no policy can miss less: it is the bound."
    if any(belady_is_bound(r) for r in runs):
        return f", but in one tier in object semantics no policy can miss less: there it is the bound. {caveat}"
    return f". Belady's MIN is the offline optimum, the bound, only in one tier in object semantics. {caveat}"


def _best_blocks(best: list[CapacityBest], picks: list[tuple[str | None, Run | None]] | None) -> list:
    """The summary's table of the best online policy per cache; in a split report (``picks``,
    ``_summary``'s) the policy tuned on the first half leads it, the hindsight winner beside it."""
    if picks is None:
        return [Paragraph("The best online policy in each cache (each capacity, or each hierarchy):"), best_table(best)]
    return [Paragraph("The policy tuned on the first half in each cache (each capacity, or each hierarchy), measured "
                      "on this half, beside the best in hindsight: the online policy that did best on this half "
                      "itself, known only after it was run:"), split_best_table(best, picks)]


def _finding(best: CapacityBest, named: bool, tied: list[Run]) -> str:
    """One key finding; ``named``: the cache is named by its tiers, not its capacity alone;
    ``tied``: its online runs where all miss the same share (``tie_finding``), else empty."""
    if tied:
        return tie_finding(best, tied, _where(best, named))
    text = f"{_where(best, named)}, {best.best.label} misses {fmt.percent(best.best.miss_ratio)} of accesses"
    text += _versus(best, best.best)
    if best.best is best.lru:
        text += f"; no other online policy beats {best.lru.label} here"
    elif best.gap_closed is not None:
        text += f", closing {fmt.percent(best.gap_closed)} of the {_gap_name(best)} gap"
    return text + (beyond_clause(best.belady) if best.beats_belady else "") + "."


def _split_finding(best: CapacityBest, named: bool, label: str | None, run: Run | None) -> str:
    """One key finding of a split report: the policy tuned on the first half (``label``, its
    ``run`` on this half) and the gap it closes, then the hindsight winner of this half."""
    where = _where(best, named)
    if run is None:
        tuned = "no policy was tuned on the first half" if label is None else f"{label}, tuned on the first half, has no run"
        return f"{where}, {tuned}; in hindsight {_hindsight(best)}."
    text = f"{where}, {run.label}, the policy tuned on the first half, misses {fmt.percent(run.miss_ratio)} of accesses"
    text += _versus(best, run)
    gap = gap_closed(run, best.lru, best.belady)
    text += "" if gap is None else f", closing {fmt.percent(gap)} of the {_gap_name(best)} gap"
    text += beyond_clause(best.belady) if beats_belady(run, best.belady) else ""
    if run is best.best:
        return f"{text}; it is also the best in hindsight (the best online policy on this half)."
    return f"{text}; in hindsight (picked on this half itself), {_hindsight(best)}."


def _gap_name(best: CapacityBest) -> str:
    """``lru–belady``: the cache's references by label (``lru+tinylfu–belady+tinylfu`` where they
    are made with the policy's own admission: ``summary.references``); both must be there."""
    return f"{best.lru.label}–{best.belady.label}"


def _hindsight(best: CapacityBest) -> str:
    """The hindsight winner's clause of a split finding."""
    text = f"{best.best.label} did best, missing {fmt.percent(best.best.miss_ratio)}"
    if best.gap_closed is not None:
        text += f" and closing {fmt.percent(best.gap_closed)}"
    return text + (beyond_clause(best.belady) if best.beats_belady else "")


def _where(best: CapacityBest, named: bool) -> str:
    """The cache a finding is about: ``At 1,000 blocks (object semantics, one tier)``."""
    cache = f"In {tiers_text(best.best)}" if named else f"At {fmt.integer(best.capacity_blocks)}"
    blocks = "block" if best.capacity_blocks == 1 else "blocks"
    return f"{cache} {blocks} ({_group_title(best.semantics, best.mode)})"


def _versus(best: CapacityBest, run: Run) -> str:
    """`` (vs lru 87.4%, belady 64.4%)``: the cache's references other than ``run``; empty if none."""
    refs = [f"{ref.label} {fmt.percent(ref.miss_ratio)}" for ref in (best.lru, best.belady) if ref is not None and ref is not run]
    return f" (vs {', '.join(refs)})" if refs else ""


def _payoff_blocks(payoffs: list[Payoff]) -> list:
    """Whether each hierarchy pays off against HBM alone (only where both were run), one list per hierarchy."""
    groups: dict[tuple, list[Payoff]] = {}
    for payoff in payoffs:
        run = payoff.hierarchy
        groups.setdefault((run.semantics, run.mode, tiers_text(run), payoff.hbm_only.capacity_blocks), []).append(payoff)
    blocks: list = []
    for (semantics, mode, tiers, hbm), group in groups.items():
        notes = "".join(f" {_MEASURE_NOTES[m]}" for m in dict.fromkeys(p.measure for p in group) if m in _MEASURE_NOTES)
        blocks.append(Paragraph(f"Does the hierarchy pay off against HBM alone? The hierarchy {tiers} blocks "
                                f"({_group_title(semantics, mode)}) against HBM {fmt.integer(hbm)} blocks alone, "
                                f"same trace, same policy.{notes}"))
        blocks.append(Bullets(tuple(_payoff_sentence(p) for p in group)))
    return blocks


def _payoff_sentence(payoff: Payoff) -> str:
    """E.g. "lru: the hierarchy pays off: it cuts misses from 85.6% to 36.0% and modeled request time from 1,908 s
    to 1,130 s; its write-backs and demotions (935 s in all, ...) run beside the requests, on their own links.", or in
    prefix semantics "... and raises modeled TTFT saved from 1.55 s to 4.22 s." (the figure ``pays_off`` judges)."""
    tiered, alone = payoff.hierarchy, payoff.hbm_only
    fewer = tiered.miss_ratio < alone.miss_ratio
    misses = f"{'cuts' if fewer else 'takes'} misses from {fmt.percent(alone.miss_ratio)} to {fmt.percent(tiered.miss_ratio)}"
    head = f"{tiered.label}: the hierarchy {'pays off' if payoff.pays_off else 'does not pay off'}: it {misses}"
    if payoff.measure == "misses":
        return f"{head} (no hardware given: time not modeled)."
    ttft = payoff.measure == "ttft"
    figure = "modeled TTFT saved" if ttft else "modeled request time"
    before, after = payoff.ttft_saved if ttft else payoff.request_seconds
    writes = "" if ttft else _background_clause(payoff)
    if payoff.pays_off:
        return f"{head} and {'raises ' if ttft else ''}{figure} from {fmt.seconds(before)} to {fmt.seconds(after)}{writes}."
    change = f"stays at {fmt.seconds(before)}" if before == after else \
        f"{'falls' if ttft else 'rises'} from {fmt.seconds(before)} to {fmt.seconds(after)}"
    return f"{head}, {'but' if fewer else 'and'} {figure} {change}{writes}."


def _background_clause(payoff: Payoff) -> str:
    """What the hierarchy's write-backs and demotions take, and whether they run beside its
    requests or hold them up (``Payoff.writes_hold_up``); empty when it has none."""
    links = payoff.background
    if not links:
        return ""
    link, busiest = max(links.items(), key=lambda item: (item[1], item[0]))
    total = fmt.seconds(sum(links.values()))
    if payoff.writes_hold_up:
        path = fmt.seconds(request_path_seconds(payoff.hierarchy.modeled_seconds))
        return (f"; its write-backs and demotions ({total} in all) hold the requests up: link {link} is busy "
                f"{fmt.seconds(busiest)}, longer than the {path} of recompute and loads")
    return (f"; its write-backs and demotions ({total} in all, the busiest link {link} {fmt.seconds(busiest)}) run "
            "beside the requests, on their own links")


def _curves(data: ReportData, colors: dict[str, str], trace: str | Trace | None) -> Section:
    block_bytes = data.layout.block_bytes if data.layout else None
    top_axis = " (the top axis gives the same capacities in bytes of KV cache)" if block_bytes else ""
    curves = [r for r in data.runs if not r.is_hierarchy]
    blocks: list = [Paragraph(
        f"Miss ratio against cache capacity, one line per policy; capacity on a log scale{top_axis}. Lower is "
        "better." + _offline_lines(curves)
        + (" The dotted grey line, in object semantics, is the compulsory-miss floor." if data.trace.kind is TraceKind.REQUESTS
           else "")
        + _hierarchy_note([r for r in data.runs if r.is_hierarchy])
    )]
    for (semantics, mode), runs in by_group(data.runs).items():
        dense = _dense_for(data, runs, semantics, mode, trace)
        floor = data.trace.compulsory_miss_ratio if semantics is Semantics.OBJECT else None
        if any(r.is_hierarchy for r in runs):
            blocks.append(_hierarchy_image(runs, colors, (semantics, mode), floor, block_bytes))
            continue
        title = f"Miss-ratio curves: {_group_title(semantics, mode)}"
        png = plots.miss_ratio_curves(runs, colors, title, floor, dense.curve if dense else None, block_bytes)
        blocks.append(Image(f"{_slug('miss_ratio', semantics, mode)}.png", png, title, _curve_caption(runs)))
        if dense is not None:
            blocks.append(Paragraph(dense.note))
    return Section("Miss-ratio curves", tuple(blocks))


def _offline_lines(runs: list[Run]) -> str:
    """What the dashed lines of the curves (single-tier runs) are: Belady's black one where a
    belady run is drawn (``_belady_line``), and those of other policies that read the future."""
    belady = [r for r in runs if is_belady(r)]
    text = f" The dashed black line ({BELADY}) {_belady_line(belady)}." if belady else ""
    others = _other_offline(runs)
    if others:
        one = len(others) == 1
        text += (f" The dashed line{'' if one else 's'} of {_listed(others)} read{'s' if one else ''} the future: "
                 f"{'a reference, not a bound' if one else 'references, not bounds'}.")
    return text


def _hierarchy_note(runs: list[Run]) -> str:
    """What the bars of hierarchy runs are, and their hatched (offline) ones; empty without any."""
    if not runs:
        return ""
    text = " A hierarchy of tiers is one configuration, not a capacity range: its runs are bars, one per policy and hierarchy"
    if any(is_belady(r) for r in runs):
        text += f"; there {BELADY}'s hatched bar is Belady's replay (MIN in each tier), a reference a policy can beat, not a bound"
    others = _other_offline(runs)
    if others:
        one = len(others) == 1
        text += (f"; the hatched bar{'' if one else 's'} of {_listed(others)} read{'s' if one else ''} the future: "
                 f"{'a reference, not a bound' if one else 'references, not bounds'}")
    return text + "."


def _belady_line(runs: list[Run]) -> str:
    """What the dashed Belady line of the curves (``runs``: its single-tier runs) is: the best
    any policy could do only where Belady is the bound (``belady_is_bound``)."""
    kinds = sorted({r.semantics.value for r in runs if not belady_is_bound(r)})
    if not kinds:
        return "is the best any policy could do"
    where = f"in {' and '.join(kinds)} semantics"
    if any(belady_is_bound(r) for r in runs):
        return (f"is Belady's replay: in object semantics the best any policy could do, {where} a reference a "
                "policy can beat")
    return f"is Belady's replay, {where} a reference a policy can beat, not the best any policy could do"


def _hierarchy_image(runs: list[Run], colors: dict[str, str], group: tuple[Semantics, Mode], floor: float | None,
                     block_bytes: int | None) -> Image:
    """A hierarchy is one configuration: bars per policy and hierarchy, not a curve over capacities."""
    title = f"Miss ratio per hierarchy: {_group_title(*group)}"
    png = plots.hierarchy_miss_ratios(runs, colors, title, floor, block_bytes)
    count = len({tuple((t.name, t.capacity_blocks, t.codec) for t in r.tiers) for r in runs})
    more = ("" if count > 1 else " Only one hierarchy was run, so there is no curve: replay others (--tiers) "
            "to see how the miss ratio changes with the tiers' sizes.")
    caption = (f"Each bar is one policy's miss ratio over the whole hierarchy (a miss is a block found in no tier), "
               f"grouped by hierarchy ({count} {'hierarchies' if count > 1 else 'hierarchy'}).{more}")
    return Image(f"{_slug('miss_ratio', *group)}.png", png, title, caption)


def _dense_for(data: ReportData, runs: list[Run], semantics: Semantics, mode: Mode,
               trace: str | Trace | None) -> LRUCurve | None:
    """The one-pass curve applies to object semantics in a single LRU tier only."""
    if semantics is not Semantics.OBJECT or mode is not Mode.SINGLE or any(r.is_hierarchy for r in runs):
        return None
    return dense_lru_curve(data.trace, trace, runs)


def _curve_caption(runs: list[Run]) -> str:
    capacities = sorted({r.capacity_blocks for r in runs})
    return f"{len(runs)} runs at {len(capacities)} capacities: {', '.join(fmt.integer(c) for c in capacities)} blocks."


def _ordered(runs: list[Run]) -> list[Run]:
    order = {label: i for i, label in enumerate(policy_labels(runs))}
    return sorted(runs, key=lambda r: (r.capacity_blocks, order[r.label]))


def _tiers(data: ReportData, colors: dict[str, str]) -> Section:
    blocks: list = []
    hierarchies = [r for r in data.runs if r.is_hierarchy]
    for (semantics, mode), runs in by_group(hierarchies).items():
        title = f"Where accesses are served: {_group_title(semantics, mode)}"
        png = plots.tier_breakdown(_ordered(runs), colors, title)
        blocks.append(Image(f"{_slug('tiers', semantics, mode)}.png", png, title,
                            "Each bar is one run, in its policy's colour: the share of block accesses that hit in each "
                            "tier (darkest: HBM), and the share that missed (grey)."))
    if hierarchies:
        blocks.append(tier_table(hierarchies))
        blocks.extend(Paragraph(text) for text in codec_sentences(hierarchies, data.layout))
    if blocks:
        blocks.insert(0, Paragraph(
            "Runs over a hierarchy of tiers, fastest first. In an exclusive hierarchy a block lives in exactly one "
            "tier and victims move down HBM → DRAM → NVMe; in a write-through hierarchy lower tiers keep copies. "
            "A hit in a slower tier avoids recomputation but still costs a transfer to HBM: it is either read where it "
            "lies or promoted to HBM, and the table below counts both, with their bytes and modeled time."))
    return Section("Per-tier hits", tuple(blocks))


def _movement(data: ReportData, colors: dict[str, str]) -> Section:
    costed = [r for r in data.runs if r.bytes_moved or r.modeled_seconds]
    if not costed:
        return Section("Data movement and modeled time", ())
    model = data.layout.name if data.layout else "none"
    hardware = data.hardware or "none"
    blocks: list = [Paragraph(
        f"Bytes each run moves over each link between tiers, and the time the link/cost model assigns to them "
        f"(transfers at the link's bandwidth plus latency; {prefill_method(data)}). Model "
        f"preset: {model}; hardware: {hardware} (a preset's name, or a profile file's own). These are modeled "
        "figures, not measurements."
    )]
    moving = [r for r in costed if any(r.bytes_moved.values())]
    for (semantics, mode), group in by_group(moving).items():
        title = f"Data movement: {_group_title(semantics, mode)} ({model} on {hardware})"
        png = plots.data_movement(_ordered(group), colors, title)
        blocks.append(Image(f"{_slug('movement', semantics, mode)}.png", png, title,
                            "Each bar is one run, in its policy's colour. Left: GiB moved per link. Right: modeled "
                            "seconds per component (palest, dashed: recompute of misses)."))
    if len(moving) < len(costed):
        blocks.append(Paragraph("Single-tier runs move nothing between tiers: their modeled time is the recompute "
                                "time of their misses, listed as 'modeled time' in the table of all runs."))
    return Section("Data movement and modeled time", tuple(blocks))


def prefill_method(data: ReportData) -> str:
    """How the runs' recompute (and TTFT saved) were modeled, as their results record it
    (``hardware_profile.prefill_model`` and ``prefill``): never a term they were computed without."""
    if data.prefill_model in (None, LEGACY_PREFILL_MODEL):
        return ("misses recomputed at the hardware's flat per-token prefill rate, as the tiercache that wrote these "
                "results modeled it: attention over the context and the model's size left out")
    info = data.prefill
    rate = "at the FLOP rate the hardware's llama-3-8b short-prompt speed implies; decode-phase costs are left out"
    if info is None:
        return ("misses recomputed at the modeled prefill FLOPs: 2 x parameters per token, plus attention over each "
                "token's prefix where the layout gave query heads (these results do not record whether it did), " + rate)
    if info.params is None:
        weights = "2 x the reference model's (llama-3-8b) parameters per token (the layout gave no params=)"
    else:
        weights = f"2 x parameters per token ({info.params:.4g} parameters)"
    if info.attention:
        attention = (f" plus attention over each token's prefix (4 x layers x query heads ({info.heads}) x head dim per "
                     "query-key pair; attention kernels assumed as efficient as the matmuls)")
    else:
        attention = " and no attention term (the layout gave no heads=: a flat per-token rate, lower bounds for long prompts)"
    return f"misses recomputed at the modeled prefill FLOPs: {weights}{attention}, {rate}"


def _prefix(data: ReportData, colors: dict[str, str]) -> Section:
    runs = [r for r in data.runs if r.semantics is Semantics.PREFIX and r.prefill_tokens_saved is not None]
    blocks: list = []
    for (_, mode), group in by_group(runs).items():
        title = f"Prefix reuse against no cache: {_group_title(Semantics.PREFIX, mode)}"
        png = plots.prefix_savings(group, colors, title)
        blocks.append(Image(f"{_slug('prefix_savings', mode)}.png", png, title, _savings_caption(group)))
    if blocks:
        blocks.insert(0, Paragraph("What prefix caching buys a serving engine: prefill work and latency saved, "
                                   "compared with running the same requests without any KV cache."))
    return Section("Prefill and time-to-first-token saved", tuple(blocks))


def _savings_caption(runs: list[Run]) -> str:
    tokens = "Prompt tokens that need no prefill because their KV was found in the cache."
    if all(r.ttft_saved_s is None for r in runs):
        return tokens + " No hardware preset was given, so no time-to-first-token is modeled."
    return (
        f"Left: {tokens[0].lower()}{tokens[1:]} Right: modeled time-to-first-token saved, summed over all requests: "
        f"{_TTFT_SAVED}. Below zero, loading blocks from slower tiers costs more than the prefill it saves."
    )


def _reproduce(data: ReportData, command: str) -> Section:
    blocks: list = [Paragraph("This report was built by:"), Code(command)]
    if data.commands and data.commands != (command,):
        blocks += [Paragraph("from results produced by:"), Code("\n".join(data.commands))]
    blocks.append(Paragraph(f"Trace fingerprint {data.trace.fingerprint}; results files: {', '.join(data.sources)}."))
    return Section("Reproduce", tuple(blocks))
