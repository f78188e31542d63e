"""Fleet replays in a report: per-instance and shared-tier hits, bytes per link, TTFT saved,
and the shared tier's gain over the same fleet on private tiers alone.

Works from the ``RunRecord``s of ``tiercache replay --instances`` (runs whose ``instances``
are set). A run with the shared ``remote`` tier is paired with its twin on private tiers
alone (same policy, route, instance count and private tiers), which the replay writes into
the same results file. ``tiercache replay`` prints ``fleet_table`` and ``gain_sentence``;
``tiercache report`` shows ``fleet_section``.
"""

from __future__ import annotations

import io

from ..results import RunRecord
from . import fmt
from .document import Image, Paragraph, Section, Table

__all__ = ["fleet_pairs", "fleet_table", "link_table", "gain_sentence", "fleet_plot", "fleet_section"]

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
    saved s]`` and a total row ``all`` (GiB with a layout and a shared tier, seconds with hardware)."""
    tiers = [t.name for t in run.tiers]
    instances = run.instances or ()
    with_bytes = "remote" in tiers and run.tiers[0].block_bytes is not None
    with_time = run.ttft_saved_s is not None
    rows = [["instance", "requests", *[f"{t} hits" for t in tiers], "misses", "hit ratio"]
            + (["remote GiB in"] if with_bytes else []) + (["TTFT saved s"] if with_time else [])]

    def extra(bytes_in: float, ttft: float | None) -> list[str]:
        return ([f"{bytes_in / 2**30:.1f}"] if with_bytes else []) + ([f"{ttft:.1f}"] if with_time else [])

    for r in instances:
        ratio = r.hits / r.accesses if r.accesses else 0.0
        rows.append([str(r.instance), str(r.requests), *[str(r.tier_hits.get(t, 0)) for t in tiers], str(r.misses),
                     f"{ratio:.4f}", *extra(_remote_in(r.bytes_moved), r.ttft_saved_s)])
    rows.append(["all", str(sum(r.requests for r in instances)), *[str(t.hits) for t in run.tiers], str(run.misses),
                 f"{run.hit_ratio:.4f}", *extra(_remote_in(run.bytes_moved), run.ttft_saved_s)])
    return rows


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
        sentence += f" Modeled TTFT saved: {shared.ttft_saved_s:.1f} s against {private.ttft_saved_s:.1f} s."
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


def _table(rows: list[list[str]], caption: str) -> Table:
    return Table(tuple(rows[0]), tuple(tuple(r) for r in rows[1:]), (False,) + (True,) * (len(rows[0]) - 1), caption)


def _setting(run: RunRecord) -> str:
    private = " + ".join(f"{fmt.tier(n)} {fmt.integer(c)}" for n, c in _private_shape(run))
    remote = [t for t in run.tiers if t.name == "remote"]
    shared = f", one shared remote tier of {fmt.integer(remote[0].capacity_blocks)} blocks" if remote else ", no shared tier"
    return f"{len(run.instances)} instances ({run.route.value}, {run.label}), private tiers {private} each{shared}"


def fleet_section(runs: list[RunRecord] | tuple[RunRecord, ...]) -> Section:
    """The report's fleet section (empty without fleet runs)."""
    blocks: list = []
    for number, (run, twin) in enumerate(fleet_pairs(runs), start=1):
        blocks.append(Paragraph(f"Fleet {number}: {_setting(run)}. Prefix semantics; remote writes through."))
        blocks.append(_table(fleet_table(run), "Hits per instance and tier ('remote': the shared tier)."))
        links = link_table(run)
        if links is not None:
            blocks.append(_table(links, "GiB moved per link (remote->hbm is staged through DRAM)."))
        if twin is not None:
            blocks.append(_table(fleet_table(twin), "The same fleet on private tiers alone."))
            blocks.append(Paragraph(gain_sentence(run, twin)))
        if run.shared_hits or twin is not None:
            blocks.append(Image(f"fleet_{number}.png", fleet_plot(run, twin), "per-instance hits",
                                "Per instance: hits per tier with the shared tier (stacked), and on private tiers alone (hatched)."))
    if blocks:
        blocks.insert(0, Paragraph(
            "A fleet replay spreads the trace's requests over several engine instances, each with private tiers, "
            "plus one remote tier they share: a prefix one instance computed is a shared-tier hit on another. "
            "TTFT saved is the prefill time of the reused tokens minus the modeled time of the loads that brought them."))
    return Section("Fleet replay: per-instance and shared-tier hits", tuple(blocks))
