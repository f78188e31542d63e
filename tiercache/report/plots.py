"""Report plots, rendered to PNG bytes with matplotlib's Agg renderer.

Figures are built with ``matplotlib.figure.Figure`` directly, never ``pyplot``: no global
figure state, no display, nothing to close, safe in worker processes and tests.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import NullLocator, PercentFormatter

from . import fmt
from .model import Run
from .summary import belady_is_bound, is_belady, is_offline, policy_labels

__all__ = ["Curve", "policy_colors", "miss_ratio_curves", "hierarchy_miss_ratios", "tier_breakdown", "data_movement",
           "prefix_savings"]

_DPI = 110
_TIER_ORDER = ("hbm", "dram", "nvme")
_OFFLINE_COLOR = "#111111"
_FLOOR_COLOR = "#7a7a7a"
_LEGEND_GREY = "#555555"
_MISS_FILL, _MISS_EDGE = "#f3f3f3", "#b5b5b5"


@dataclass(frozen=True)
class _Shade:
    """How one part of a stacked bar is drawn: the run's policy colour, lightened, hatched.

    A colour always names a policy (``policy_colors``), in every plot; tiers, links and cost
    components are told apart by lightness and hatch, never by a colour of their own.
    """

    lighten: float
    hatch: str


_SHADES = (_Shade(0.0, ""), _Shade(0.45, "//"), _Shade(0.7, ".."), _Shade(0.3, "xx"), _Shade(0.6, "\\\\"),
           _Shade(0.8, "++"))
_RECOMPUTE = _Shade(0.88, "--")


@dataclass(frozen=True)
class Curve:
    """A dense curve drawn under the per-run points (the one-pass LRU curve)."""

    capacities: np.ndarray
    miss_ratios: np.ndarray
    label: str


def policy_colors(runs: list[Run] | tuple[Run, ...]) -> dict[str, str]:
    """One color per policy label, the same in every plot; Belady is black (``is_belady``),
    other offline policies take the palette after the online ones."""
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#bcbd22"]
    belady = {r.label for r in runs if is_belady(r)}
    others = [label for label in policy_labels(runs) if label not in belady]
    colors = {label: palette[i % len(palette)] for i, label in enumerate(others)}
    return colors | {label: _OFFLINE_COLOR for label in belady}


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=_DPI, facecolor="white")
    return buffer.getvalue()


def _capacity_ticks(ax, capacities: list[int]) -> None:
    """Ticks at exactly the capacities that ran, labelled as the CLI prints them."""
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(capacities)
    ax.set_xticklabels([fmt.integer(c) for c in capacities])


def miss_ratio_curves(
    runs: list[Run],
    colors: dict[str, str],
    title: str,
    floor: float | None,
    dense: Curve | None,
    block_bytes: int | None,
) -> bytes:
    """Miss ratio against capacity (log x): one line per policy, offline ones dashed (``_offline_label``).

    Args:
        runs: runs of one (semantics, mode) group.
        colors: from ``policy_colors``.
        title: the figure title.
        floor: compulsory-miss ratio drawn as a horizontal line, or None.
        dense: a dense LRU curve to draw under the points, or None.
        block_bytes: bytes per block, to add a GiB axis on top; None without a layout.
    """
    fig = Figure(figsize=(10, 5.2), layout="constrained")
    ax = fig.add_subplot()
    if dense is not None:
        ax.plot(dense.capacities, dense.miss_ratios, color=colors.get("lru", "#1f77b4"), lw=4, alpha=0.22,
                solid_capstyle="round", label=dense.label)
    for label in policy_labels(runs):
        _plot_policy(ax, sorted((r for r in runs if r.label == label), key=lambda r: r.capacity_blocks), colors[label])
    if floor is not None:
        ax.axhline(floor, color=_FLOOR_COLOR, ls=":", lw=1.6, label=f"compulsory-miss floor ({fmt.percent(floor)}): first accesses")
    shown = [r.miss_ratio for r in runs] + ([floor] if floor is not None else [])
    _style_miss_axes(ax, sorted({r.capacity_blocks for r in runs}), block_bytes)
    ax.set_ylim(*_miss_ylim(shown))
    ax.set_title(title, loc="left", fontsize=12)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    return _png(fig)


def _offline_label(run: Run) -> str:
    """The legend entry of an offline policy's run: the bound only for Belady's MIN where it
    is the offline optimum (``belady_is_bound``), else Belady's replay, which a policy can beat;
    another policy that reads the future is a reference (``is_belady``)."""
    if not is_belady(run):
        return f"{run.label} (reads the future: a reference, not a bound)"
    if belady_is_bound(run):
        return f"{run.label} (offline optimum: the bound)"
    return f"{run.label} (Belady's replay: a reference, not a bound)"


def _plot_policy(ax, runs: list[Run], color: str) -> None:
    label = runs[0].label
    if is_offline(runs[0]):
        ax.plot([r.capacity_blocks for r in runs], [r.miss_ratio for r in runs], color=color,
                ls="--" if len(runs) > 1 else "none", lw=1.8,
                marker="D", ms=5, label=_offline_label(runs[0]), zorder=3)
        return
    # A policy replayed at one capacity is a point, and its legend key says so (no line).
    ax.plot([r.capacity_blocks for r in runs], [r.miss_ratio for r in runs], color=color, lw=1.8, marker="o", ms=5,
            ls="-" if len(runs) > 1 else "none", label=label, zorder=3)


def hierarchy_miss_ratios(runs: list[Run], colors: dict[str, str], title: str, floor: float | None,
                          block_bytes: int | None) -> bytes:
    """Miss ratio of each policy over each hierarchy: grouped bars, one group per hierarchy.

    A hierarchy is one configuration, not a range of capacities, so each policy is one bar
    per hierarchy (labelled with its tiers), never a line through a single point.

    Args:
        runs: hierarchy runs of one (semantics, mode) group.
        colors: from ``policy_colors``.
        title: the figure title.
        floor: compulsory-miss ratio drawn as a horizontal line, or None.
        block_bytes: bytes per block, to give each hierarchy's size in bytes; None without a layout.
    """
    splits = sorted({_split(r) for r in runs}, key=lambda s: (sum(t[1] for t in s), [(n, c, k, b or 0) for n, c, k, b in s]))
    labels = policy_labels(runs)
    fig = Figure(figsize=(max(7.5, 2.2 * len(splits) * max(1.0, len(labels) / 4) + 3.5), 5.0), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        _policy_bars(ax, [r for r in runs if r.label == label], splits, (i - (len(labels) - 1) / 2) * width, width,
                     colors[label])
    if floor is not None:
        ax.axhline(floor, color=_FLOOR_COLOR, ls=":", lw=1.6, label=f"compulsory-miss floor ({fmt.percent(floor)}): first accesses")
    ax.set_xticks(np.arange(len(splits)))
    ax.set_xticklabels([_split_text(s, block_bytes) for s in splits], fontsize=8)
    ax.set_xlim(-0.6, len(splits) - 0.4)
    ax.set_ylim(0, min(1.0, max(r.miss_ratio for r in runs) * 1.15 + 0.02))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_ylabel("miss ratio over the whole hierarchy (%)")
    ax.set_xlabel("hierarchy (tiers and their capacities in blocks, fastest first)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title(title, loc="left", fontsize=12)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    return _png(fig)


def _split(run: Run) -> tuple[tuple[str, int, str, int | None], ...]:
    """``(tier, capacity, codec, bytes per block)`` of each tier of a hierarchy."""
    return tuple((t.name, t.capacity_blocks, t.codec, t.block_bytes) for t in run.tiers)


def _split_text(split: tuple[tuple[str, int, str, int | None], ...], block_bytes: int | None) -> str:
    lines = [f"{fmt.tier(name)} {fmt.integer(cap)}" + fmt.codec_suffix(codec) for name, cap, codec, _ in split]
    total = sum(cap for _, cap, _, _ in split)
    nbytes = sum(cap * (tier_bytes or block_bytes or 0) for _, cap, _, tier_bytes in split)
    size = f" = {fmt.size(nbytes)}" if block_bytes else ""
    return "\n".join(lines + [f"(total {fmt.integer(total)}{size})"])


def _policy_bars(ax, runs: list[Run], splits: list, offset: float, width: float, color: str) -> None:
    """One policy's bars, one per hierarchy it ran on, with the miss ratio written above each."""
    by_split = {_split(r): r for r in runs}
    xs = [i + offset for i, s in enumerate(splits) if s in by_split]
    values = [by_split[s].miss_ratio for s in splits if s in by_split]
    offline = is_offline(runs[0])
    label = _offline_label(runs[0]) if offline else runs[0].label
    ax.bar(xs, values, width=width * 0.92, color=color, label=label, hatch="//" if offline else "",
           edgecolor="white" if offline else color, zorder=3)
    for x, value in zip(xs, values):
        ax.text(x, value + 0.005, fmt.percent(value), ha="center", va="bottom", fontsize=7, rotation=90 if width < 0.15 else 0)


def _miss_ylim(values: list[float]) -> tuple[float, float]:
    """Y range rounded out to 10% steps around the data.

    Policies often differ by a few percent; a fixed 0-100% axis would flatten exactly the
    differences the plot is for. The percent tick labels show where the axis starts.
    """
    low = max(0.0, math.floor((min(values) - 0.03) * 10) / 10)
    high = min(1.0, math.ceil((max(values) + 0.03) * 10) / 10)
    return low, max(high, low + 0.1)


def _style_miss_axes(ax, capacities: list[int], block_bytes: int | None) -> None:
    ax.set_xscale("log")
    lo, hi = capacities[0], capacities[-1]
    ax.set_xlim(lo / 1.6, hi * 1.6)
    _capacity_ticks(ax, capacities)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_xlabel("cache capacity (blocks, log scale)")
    ax.set_ylabel("miss ratio (% of block accesses)")
    ax.grid(True, which="major", alpha=0.3)
    if block_bytes:
        _size_axis(ax, capacities, block_bytes)


def _size_axis(ax, capacities: list[int], block_bytes: int) -> None:
    """A top axis giving each replayed capacity in bytes, tick for tick with the block axis."""
    top = ax.secondary_xaxis("top")  # identity transform: same positions, other labels
    top.xaxis.set_minor_locator(NullLocator())
    top.set_xticks(capacities)
    top.set_xticklabels([fmt.size(c * block_bytes) for c in capacities])
    top.set_xlabel("the same capacity in bytes of KV cache")


def _bar_labels(runs: list[Run]) -> list[str]:
    return [f"{r.label}\n{fmt.integer(r.capacity_blocks)}" for r in runs]


def _lighter(color: str, amount: float) -> tuple[float, float, float]:
    """``color`` blended towards white by ``amount`` (0: unchanged, 1: white)."""
    return tuple(c + (1.0 - c) * amount for c in to_rgb(color))


def _stacked_bars(ax, runs: list[Run], stacks: dict[str, list[float]], shades: dict[str, _Shade | None],
                  colors: dict[str, str]) -> None:
    """One stacked bar per run in its policy's colour; ``stacks`` maps a part to one value per run.

    A part whose shade is None is the miss share: drawn pale grey, not in a policy colour.
    """
    x = np.arange(len(runs))
    bottom = np.zeros(len(runs))
    base = [colors.get(r.label, _OFFLINE_COLOR) for r in runs]
    for name, values in stacks.items():
        shade = shades[name]
        fill = [_MISS_FILL] * len(runs) if shade is None else [_lighter(c, shade.lighten) for c in base]
        edge = [_MISS_EDGE] * len(runs) if shade is None else base
        ax.bar(x, values, bottom=bottom, color=fill, edgecolor=edge, hatch=shade.hatch if shade else "", width=0.75, lw=0.6)
        bottom += np.asarray(values, dtype=float)
    _run_ticks(ax, runs, base)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _run_ticks(ax, runs: list[Run], base: list[str]) -> None:
    """One tick per run, labelled with policy and capacity in the policy's colour."""
    ax.set_xticks(np.arange(len(runs)))
    ax.set_xticklabels(_bar_labels(runs), fontsize=8, rotation=90 if len(runs) > 12 else 0)
    for tick, color in zip(ax.get_xticklabels(), base):
        tick.set_color(color)
    ax.set_xlim(-0.6, len(runs) - 0.4)


def _shade_legend(shades: dict[str, _Shade | None]) -> list[Patch]:
    """Legend keys for the parts of a stacked bar, in grey: the colour belongs to the policy."""
    keys = []
    for name, shade in shades.items():
        if shade is None:
            keys.append(Patch(facecolor=_MISS_FILL, edgecolor=_MISS_EDGE, label=name))
        else:
            keys.append(Patch(facecolor=_lighter(_LEGEND_GREY, shade.lighten), edgecolor=_LEGEND_GREY,
                              hatch=shade.hatch, label=name))
    return keys


def _bar_width(runs: list[Run], per_bar: float, minimum: float) -> float:
    """Figure width that keeps bars readable however many runs there are."""
    return max(minimum, per_bar * len(runs) + 3)


def tier_breakdown(runs: list[Run], colors: dict[str, str], title: str) -> bytes:
    """Stacked bars per hierarchy run: share of accesses served by each tier, and missed.

    Each bar has its policy's colour (``policy_colors``); the tiers are shades of it, darkest
    for the fastest tier, and the miss share is pale grey.
    """
    tier_names = [n for n in _TIER_ORDER if any(t.name == n for r in runs for t in r.tiers)]
    stacks = {f"{fmt.tier(name)} hit": [_tier_hits(r, name) / r.accesses if r.accesses else 0.0 for r in runs]
              for name in tier_names}
    shades: dict[str, _Shade | None] = {name: _SHADES[i] for i, name in enumerate(stacks)}
    stacks["miss"], shades["miss"] = [r.miss_ratio for r in runs], None
    fig = Figure(figsize=(_bar_width(runs, 0.55, 7.0), 4.8), layout="constrained")
    ax = fig.add_subplot()
    _stacked_bars(ax, runs, stacks, shades, colors)
    for x, run in enumerate(runs):
        # Hit shares can be thin slivers under a tall miss bar: print the total on the bar.
        ax.text(x, run.hit_ratio + 0.01, f"{fmt.percent(run.hit_ratio)}\nhit", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, 1.0)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_ylabel("share of block accesses (%)")
    ax.set_xlabel("policy and total capacity (blocks); colour = policy")
    ax.set_title(title, loc="left", fontsize=12)
    ax.legend(handles=_shade_legend(shades), loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9,
              title="tier (shade of the\npolicy's colour)", title_fontsize=8)
    return _png(fig)


def _tier_hits(run: Run, name: str) -> int:
    return sum(t.hits for t in run.tiers if t.name == name)


def _component_shades(names: list[str]) -> dict[str, _Shade | None]:
    links = [n for n in names if n != "recompute"]
    shades: dict[str, _Shade | None] = {name: _SHADES[i % len(_SHADES)] for i, name in enumerate(links)}
    return shades | ({"recompute": _RECOMPUTE} if "recompute" in names else {})


def data_movement(runs: list[Run], colors: dict[str, str], title: str) -> bytes:
    """Per run: bytes moved on each link (when any link moved data), and modeled seconds by component."""
    links = sorted({k for r in runs for k, v in r.bytes_moved.items() if v})
    parts = sorted({k for r in runs for k in r.modeled_seconds if k != "total"}, key=lambda k: (k == "recompute", k))
    panels = (["bytes"] if links else []) + (["time"] if parts else [])
    fig = Figure(figsize=(_bar_width(runs, 0.6 * len(panels), 6.0 * len(panels)), 4.8), layout="constrained")
    axes = dict(zip(panels, fig.subplots(1, len(panels), squeeze=False)[0]))
    shades = _component_shades(sorted(set(links) | set(parts), key=lambda k: (k == "recompute", k)))  # one key, both panels
    if links:
        stacks = {link: [r.bytes_moved.get(link, 0) / 2**30 for r in runs] for link in links}
        _movement_panel(axes["bytes"], runs, stacks, (colors, shades), ("bytes moved per link", "bytes moved (GiB)", "link"))
    if parts:
        stacks = {part: [r.modeled_seconds.get(part, 0.0) for r in runs] for part in parts}
        _movement_panel(axes["time"], runs, stacks, (colors, shades), ("modeled time by component", "modeled time (s)", "component"))
    fig.suptitle(title, x=0.01, ha="left", fontsize=12)
    return _png(fig)


def _movement_panel(ax, runs: list[Run], stacks: dict[str, list[float]], styles: tuple[dict, dict],
                    texts: tuple[str, str, str]) -> None:
    """One panel of ``data_movement``; ``styles`` is (policy colours, shades), ``texts`` (title, y label, legend title)."""
    colors, shades = styles[0], {name: styles[1][name] for name in stacks}
    _stacked_bars(ax, runs, stacks, shades, colors)
    ax.set_ylabel(texts[1])
    ax.set_title(texts[0], fontsize=10)
    ax.legend(handles=_shade_legend(shades), loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(4, len(stacks)),
              fontsize=8, frameon=False, title=f"{texts[2]} (shade of the policy's colour)", title_fontsize=8)


def prefix_savings(runs: list[Run], colors: dict[str, str], title: str) -> bytes:
    """Prefix semantics: share of prefill tokens and modeled time-to-first-token saved, against capacity."""
    with_ttft = any(r.ttft_saved_s is not None for r in runs)
    fig = Figure(figsize=(12 if with_ttft else 7.5, 4.6), layout="constrained")
    axes = fig.subplots(1, 2 if with_ttft else 1, squeeze=False)[0]
    for label in policy_labels(runs):
        mine = sorted((r for r in runs if r.label == label), key=lambda r: r.capacity_blocks)
        line, marker = ("--", "D") if is_offline(mine[0]) else ("-", "o")
        x = [r.capacity_blocks for r in mine]
        saved = [(r.prefill_tokens_saved or 0) / r.prefill_tokens if r.prefill_tokens else 0.0 for r in mine]
        axes[0].plot(x, saved, color=colors[label], label=label, ls=line, marker=marker, ms=5)
        if with_ttft:
            ttft = [r.ttft_saved_s or 0.0 for r in mine]
            axes[1].plot(x, ttft, color=colors[label], label=label, ls=line, marker=marker, ms=5)
    axes[0].yaxis.set_major_formatter(PercentFormatter(1.0))
    axes[0].set_ylabel("prefill tokens saved (% of all prompt tokens)")
    axes[0].set_title("prefill work saved", fontsize=10)
    if with_ttft:
        axes[1].set_ylabel("modeled TTFT saved (s, all requests)")
        axes[1].set_title("time-to-first-token saved (modeled)", fontsize=10)
    for ax in axes:
        _savings_axes(ax, sorted({r.capacity_blocks for r in runs}))
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    fig.suptitle(title, x=0.01, ha="left", fontsize=12)
    return _png(fig)


def _savings_axes(ax, capacities: list[int]) -> None:
    ax.set_xscale("log")
    _capacity_ticks(ax, capacities)
    ax.set_xlabel("cache capacity (blocks, log scale)")
    low, high = ax.get_ylim()
    # Zero is always in view: savings can be negative (transfers cost more than they save).
    ax.set_ylim(min(0.0, low), max(0.0, high))
    ax.axhline(0.0, color="#555555", lw=0.8)
    ax.grid(True, alpha=0.3)
