"""Fleet replays in a report: per-instance and shared-tier hits, bytes per link, TTFT saved,
and the shared tier's gain over the same fleet on private tiers alone.

Works from the ``RunRecord``s of ``tiercache replay --instances`` (runs whose ``instances``
are set). A run with the shared ``remote`` tier is paired with its twin on private tiers
alone (same policy, route, instance count and private tiers), which the replay writes into
the same results file. ``tiercache replay`` prints ``fleet_table`` and ``gain_sentence``;
``tiercache report`` shows ``fleet_section``.

A fleet of more than ``LISTED_INSTANCES`` instances is summarised in the report instead of
listed (its tables and plot would grow with the instance count: 20,000 instances took
145 s and drew an unreadable plot): each table gives the minimum, median and maximum over
the instances per column, the ``EXTREMES`` instances with the lowest and the highest hit
ratio, and the ``all`` row (``fleet_summary_table``, ``link_summary_table``), and the plot
shows the instances' hits ranked (``fleet_distribution_plot``), its cost linear in the
instance count and its size fixed.
"""

from __future__ import annotations

import io
import statistics
from typing import Callable

from ..config import RemoteWrite
from ..results import InstanceRecord, RunRecord
from . import fmt
from .document import Image, Paragraph, Section, Table

__all__ = ["fleet_pairs", "tenths", "fleet_table", "link_table", "gain_sentence", "fleet_plot", "fleet_section",
           "fleet_summary_table", "summary_note", "link_summary_table", "fleet_distribution_plot", "write_text",
           "LISTED_INSTANCES", "EXTREMES"]

#: The most instances a report lists one by one (a table row and a bar each); above it, summaries.
LISTED_INSTANCES = 32
#: Instances a summary names at either end of the hit-ratio order.
EXTREMES = 3

_SHADES = {"hbm": "#1f4e79", "dram": "#5b9bd5", "nvme": "#a9c9ea", "remote": "#e07b39"}


def _private_shape(run: RunRecord) -> tuple:
    return tuple((t.name, t.capacity_blocks) for t in run.tiers if t.name != "remote")


def _twin_key(run: RunRecord) -> tuple:
    return (run.policy, run.route, len(run.instances or ()), _private_shape(run))


def _has_remote(run: RunRecord) -> bool:
    return any(t.name == "remote" for t in run.tiers)


def fleet_pairs(runs: list[RunRecord] | tuple[RunRecord, ...]) -> list[tuple[RunRecord, RunRecord | None]]:
    """Each fleet run with the shared tier, beside its twin on private tiers alone (None when
    absent); a private-only run without a shared twin stands alone, as ``(run, None)``."""
    fleets = [r for r in runs if r.is_fleet]
    private = {_twin_key(r): r for r in fleets if not _has_remote(r)}
    pairs, used = [], set()
    for run in fleets:
        if _has_remote(run):
            twin = private.get(_twin_key(run))
            pairs.append((run, twin))
            used.add(id(twin))
    return pairs + [(r, None) for r in private.values() if id(r) not in used]


def fleet_table(run: RunRecord) -> list[list[str]]:
    """Rows ``instance, requests, <tier> hits..., misses, hit ratio[, remote GiB in][, TTFT
    saved s]``, one per instance, and a total row ``all`` (GiB with a layout and a shared
    tier, seconds with hardware)."""
    columns = _columns(run)
    rows = [[str(r.instance), *[text(value(r)) for _, value, text in columns]] for r in run.instances or ()]
    return [_header(columns), *rows, _all_row(run, columns)]


def fleet_summary_table(run: RunRecord) -> list[list[str]]:
    """``fleet_table``'s columns over many instances: rows ``min``, ``median`` and ``max`` of
    each column over the instances (each column on its own: they need not be one
    instance's), then the ``EXTREMES`` instances with the lowest and the ``EXTREMES`` with the
    highest hit ratio (by hit ratio, then instance number; each listed once), then ``all``."""
    columns, instances = _columns(run), run.instances or ()
    rows = [[name, *[text(pick([value(r) for r in instances])) for _, value, text in columns]]
            for name, pick in _STATISTICS]
    rows += [[str(r.instance), *[text(value(r)) for _, value, text in columns]] for r in _extremes(instances)]
    return [_header(columns), *rows, _all_row(run, columns)]


_Column = tuple[str, Callable[[InstanceRecord], float], Callable[[float], str]]
_STATISTICS = (("min", min), ("median", statistics.median), ("max", max))


def tenths(value: float) -> str:
    """``value`` to one decimal, a value that rounds to zero as ``0.0`` (never ``-0.0``)."""
    text = f"{value:.1f}"
    return "0.0" if text == "-0.0" else text


def _number(value: float) -> str:
    """An integer column's figure (a median of an even count may end in .5)."""
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def _columns(run: RunRecord) -> list[_Column]:
    """``fleet_table``'s columns after ``instance``: name, an instance's value, its text."""
    tiers = [t.name for t in run.tiers]
    columns: list[_Column] = [("requests", lambda r: r.requests, _number)]
    columns += [(f"{t} hits", lambda r, t=t: r.tier_hits.get(t, 0), _number) for t in tiers]
    columns += [("misses", lambda r: r.misses, _number), ("hit ratio", _hit_ratio, "{:.4f}".format)]
    if "remote" in tiers and run.tiers[0].block_bytes is not None:
        columns.append(("remote GiB in", lambda r: _remote_in(r.bytes_moved) / 2**30, "{:.1f}".format))
    if run.ttft_saved_s is not None:
        columns.append(("TTFT saved s", lambda r: r.ttft_saved_s, tenths))
    return columns


def _hit_ratio(record: InstanceRecord) -> float:
    return record.hits / record.accesses if record.accesses else 0.0


def _header(columns: list[_Column]) -> list[str]:
    return ["instance", *[name for name, _, _ in columns]]


def _all_row(run: RunRecord, columns: list[_Column]) -> list[str]:
    """The fleet's totals in ``columns`` (its hit ratio, bytes and seconds the run's own)."""
    totals = {"requests": sum(r.requests for r in run.instances or ()), "misses": run.misses, "hit ratio": run.hit_ratio,
              "remote GiB in": _remote_in(run.bytes_moved) / 2**30, "TTFT saved s": run.ttft_saved_s}
    totals |= {f"{t.name} hits": t.hits for t in run.tiers}
    return ["all", *[text(totals[name]) for name, _, text in columns]]


def _extremes(instances) -> list[InstanceRecord]:
    """The ``EXTREMES`` instances of lowest and of highest hit ratio, in that order, each once."""
    ranked = sorted(instances, key=lambda r: (_hit_ratio(r), r.instance))
    return ranked if len(ranked) <= 2 * EXTREMES else ranked[:EXTREMES] + ranked[-EXTREMES:]


def _remote_in(bytes_moved: dict) -> float:
    """Bytes read from the shared tier."""
    return sum(v for k, v in bytes_moved.items() if k.startswith("remote->"))


def link_table(run: RunRecord) -> list[list[str]] | None:
    """GiB moved per link, one row per instance and a total row (None without a layout)."""
    links = sorted(run.bytes_moved)
    if not links:
        return None
    rows = [["instance", *[f"{link} GiB" for link in links]]]
    for r in run.instances or ():
        rows.append([str(r.instance), *[f"{r.bytes_moved.get(k, 0) / 2**30:.1f}" for k in links]])
    return rows + [["all", *[f"{run.bytes_moved[k] / 2**30:.1f}" for k in links]]]


def link_summary_table(run: RunRecord) -> list[list[str]] | None:
    """``link_table`` over many instances: rows ``min``, ``median`` and ``max`` of each link's
    GiB over the instances, then ``all`` (None without a layout)."""
    links = sorted(run.bytes_moved)
    if not links:
        return None
    rows = [["instance", *[f"{link} GiB" for link in links]]]
    for name, pick in _STATISTICS:
        rows.append([name, *[f"{pick([r.bytes_moved.get(k, 0) for r in run.instances]) / 2**30:.1f}" for k in links]])
    return rows + [["all", *[f"{run.bytes_moved[k] / 2**30:.1f}" for k in links]]]


def gain_sentence(shared: RunRecord, private: RunRecord) -> str:
    """What the shared tier adds over the same fleet's private tiers alone."""
    extra = shared.hits - private.hits
    relative = f"{extra / private.hits:+.1%}" if private.hits else "no private hits to compare with"
    remote = next(t for t in shared.tiers if t.name == "remote")
    tokens = (shared.prefill_tokens_saved or 0) - (private.prefill_tokens_saved or 0)
    sentence = (f"The shared tier ({remote.capacity_blocks} blocks) serves {shared.shared_hits} hits; with it the fleet "
                f"reuses {shared.hits} blocks (hit ratio {shared.hit_ratio:.4f}) against {private.hits} "
                f"({private.hit_ratio:.4f}) on private tiers alone: {extra:+d} blocks ({relative}), "
                f"{tokens:+,d} prefill tokens saved.")
    if shared.ttft_saved_s is not None and private.ttft_saved_s is not None:
        sentence += f" Modeled TTFT saved: {tenths(shared.ttft_saved_s)} s against {tenths(private.ttft_saved_s)} s."
    return sentence


def fleet_plot(shared: RunRecord, private: RunRecord | None) -> bytes:
    """Stacked bars per instance: hits per local tier and from the shared tier, beside the
    private-only run's hits (hatched) when there is one."""
    from matplotlib.figure import Figure  # here, not at module level: the CLI starts without matplotlib

    figure = Figure(figsize=(7, 3.6), dpi=110)
    axes = figure.add_subplot()
    alone = private.instances if private is not None else [None] * len(shared.instances)
    for index, (with_shared, baseline) in enumerate(zip(shared.instances, alone)):
        bottom = 0
        for tier in (t.name for t in shared.tiers):
            value = with_shared.tier_hits.get(tier, 0)
            axes.bar(index - 0.2, value, 0.38, bottom=bottom, color=_SHADES.get(tier, "#888"), label=tier if index == 0 else None)
            bottom += value
        if baseline is not None:
            axes.bar(index + 0.2, baseline.hits, 0.38, color="white", edgecolor="#444", hatch="//",
                     label="private tiers alone" if index == 0 else None)
    axes.set_xticks(range(len(shared.instances)), [f"instance {r.instance}" for r in shared.instances])
    axes.set_ylabel("blocks reused (hits)")
    axes.legend(fontsize=8, frameon=False)
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png")
    return out.getvalue()


def fleet_distribution_plot(shared: RunRecord, private: RunRecord | None) -> bytes:
    """Many instances: their hits ranked from most to fewest, with the shared tier (in all,
    and from the shared tier) and, when there is one, on private tiers alone, each curve
    ranked on its own. Cost linear in the instance count, the figure's size fixed."""
    from matplotlib.figure import Figure  # here, not at module level: the CLI starts without matplotlib

    figure = Figure(figsize=(7, 3.6), dpi=110)
    axes = figure.add_subplot()
    remote = [r.tier_hits.get("remote", 0) for r in shared.instances]
    curves = [("with the shared tier", [r.hits for r in shared.instances], _SHADES["hbm"], "-"),
              ("of which from the shared tier", remote, _SHADES["remote"], "-")]
    if private is not None:
        curves.append(("private tiers alone", [r.hits for r in private.instances], "#444", "--"))
    for label, values, colour, style in curves:
        axes.plot(range(1, len(values) + 1), sorted(values, reverse=True), style, color=colour, label=label, linewidth=1.2)
    axes.set_xlabel(f"instances, ranked by hits ({len(shared.instances):,})")
    axes.set_ylabel("blocks reused (hits)")
    axes.set_ylim(bottom=0)
    axes.legend(fontsize=8, frameon=False, loc="upper right")  # explicit: "best" scans every point
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png")
    return out.getvalue()


def _table(rows: list[list[str]], caption: str) -> Table:
    return Table(tuple(rows[0]), tuple(tuple(r) for r in rows[1:]), (False,) + (True,) * (len(rows[0]) - 1), caption)


def write_text(run: RunRecord, lead: str = "") -> str:
    """``write back``: how a fleet run's instances wrote to its shared tier (``write selective
    (after 2 local hits)``), after ``lead``; empty for a run without a shared tier."""
    if run.remote_write is None:
        return ""
    after = f" (after {run.write_hits} local hits)" if run.remote_write is RemoteWrite.SELECTIVE else ""
    return f"{lead}write {run.remote_write.value}{after}"


_HOW = {RemoteWrite.THROUGH: "each request's blocks once it is served",
        RemoteWrite.BACK: "only the victims of their last private tier",
        RemoteWrite.SELECTIVE: "a block once they hit it that often locally, and only such victims"}


def _setting(run: RunRecord) -> str:
    private = " + ".join(f"{fmt.tier(n)} {fmt.integer(c)}" for n, c in _private_shape(run))
    remote = [t for t in run.tiers if t.name == "remote"]
    shared = f", one shared remote tier of {fmt.integer(remote[0].capacity_blocks)} blocks" if remote else ", no shared tier"
    how = f"{run.route.value}, {run.label}{write_text(run, ', ')}"
    return f"{len(run.instances)} instances ({how}), private tiers {private} each{shared}"


def _writes(run: RunRecord) -> str:
    """What the instances wrote to the shared tier, as a sentence (empty without one)."""
    return "" if run.remote_write is None else f" The instances write to the shared tier {_HOW[run.remote_write]}."


def fleet_section(runs: list[RunRecord] | tuple[RunRecord, ...]) -> Section:
    """The report's fleet section (empty without fleet runs): per fleet, its tables and plot,
    one row and one bar per instance up to ``LISTED_INSTANCES`` instances, summaries above."""
    blocks: list = []
    for number, (run, twin) in enumerate(fleet_pairs(runs), start=1):
        blocks.append(Paragraph(f"Fleet {number}: {_setting(run)}. Prefix semantics.{_writes(run)}"))
        blocks += _fleet_blocks(number, run, twin, len(run.instances) > LISTED_INSTANCES)
    if blocks:
        blocks.insert(0, Paragraph(
            "A fleet replay spreads the trace's requests over several engine instances, each with private tiers, "
            "plus one remote tier they share: a prefix one instance computed is a shared-tier hit on another. "
            "TTFT saved is the prefill time of the reused tokens minus the modeled time of the loads that brought them."))
    return Section("Fleet replay: per-instance and shared-tier hits", tuple(blocks))


def _fleet_blocks(number: int, run: RunRecord, twin: RunRecord | None, many: bool) -> list:
    """One fleet's tables, gain and plot; ``many``: summarised, not listed per instance."""
    table, links_of = (fleet_summary_table, link_summary_table) if many else (fleet_table, link_table)
    note = f" {summary_note(len(run.instances))}" if many else ""
    blocks = [_table(table(run), f"Hits per instance and tier ('remote': the shared tier).{note}")]
    links = links_of(run)
    if links is not None:
        summary = f" Min, median and max over the {len(run.instances):,} instances, then all." if many else ""
        blocks.append(_table(links, f"GiB moved per link (remote->hbm is staged through DRAM).{summary}"))
    if twin is not None:
        blocks.append(_table(table(twin), f"The same fleet on private tiers alone.{note}"))
        blocks.append(Paragraph(gain_sentence(run, twin)))
    if run.shared_hits or twin is not None:
        blocks.append(_plot_image(number, run, twin, many))
    return blocks


def summary_note(count: int) -> str:
    """The line that says what a summarised fleet table holds (``fleet_summary_table``)."""
    return (f"{count:,} instances, more than the {LISTED_INSTANCES} listed one by one: min, median and max of each "
            f"column over the instances (each column on its own), then the {EXTREMES} instances with the lowest and "
            f"the {EXTREMES} with the highest hit ratio, then all.")


def _plot_image(number: int, run: RunRecord, twin: RunRecord | None, many: bool) -> Image:
    if many:
        return Image(f"fleet_{number}.png", fleet_distribution_plot(run, twin), "hits per instance, ranked",
                     "Per instance, ranked from most to fewest hits: with the shared tier, of which from the shared "
                     "tier, and on private tiers alone (each curve ranked on its own).")
    return Image(f"fleet_{number}.png", fleet_plot(run, twin), "per-instance hits",
                 "Per instance: hits per tier with the shared tier (stacked), and on private tiers alone (hatched).")
