"""Report plots, rendered to PNG bytes with matplotlib's Agg renderer.

Figures are built with ``matplotlib.figure.Figure`` directly, never ``pyplot``: no global
figure state, no display, nothing to close, safe in worker processes and tests.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator, PercentFormatter

from . import fmt
from .model import Run
from .summary import is_offline, policy_labels

__all__ = ["Curve", "policy_colors", "miss_ratio_curves", "tier_breakdown", "data_movement", "prefix_savings"]

_DPI = 110
_TIER_COLORS = {"hbm": "#2f8f46", "dram": "#3a6fb0", "nvme": "#d9822b", "miss": "#c9c9c9"}
_OFFLINE_COLOR = "#111111"
_FLOOR_COLOR = "#7a7a7a"


@dataclass(frozen=True)
class Curve:
    """A dense curve drawn under the per-run points (the one-pass LRU curve)."""

    capacities: np.ndarray
    miss_ratios: np.ndarray
    label: str


def policy_colors(runs: list[Run] | tuple[Run, ...]) -> dict[str, str]:
    """One color per policy label, the same in every plot; offline policies are black."""
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#bcbd22"]
    offline = {r.label for r in runs if is_offline(r.policy)}
    online = [label for label in policy_labels(runs) if label not in offline]
    colors = {label: palette[i % len(palette)] for i, label in enumerate(online)}
    return colors | {label: _OFFLINE_COLOR for label in offline}


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
    """Miss ratio against capacity (log x): one line per policy, Belady as the bound.

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


def _plot_policy(ax, runs: list[Run], color: str) -> None:
    label = runs[0].label
    if is_offline(runs[0].policy):
        ax.plot([r.capacity_blocks for r in runs], [r.miss_ratio for r in runs], color=color, ls="--", lw=1.8,
                marker="D", ms=5, label=f"{label} (offline optimum: the bound)", zorder=3)
        return
    ax.plot([r.capacity_blocks for r in runs], [r.miss_ratio for r in runs], color=color, lw=1.8, marker="o", ms=5,
            label=label, zorder=3)


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


def _stacked_bars(ax, labels: list[str], stacks: dict[str, list[float]], colors: dict[str, str]) -> None:
    """Draws one stacked bar per label; ``stacks`` maps a legend name to one value per bar."""
    x = np.arange(len(labels))
    bottom = np.zeros(len(labels))
    for name, values in stacks.items():
        ax.bar(x, values, bottom=bottom, color=colors[name], label=name, width=0.75, edgecolor="white", lw=0.5)
        bottom += np.asarray(values, dtype=float)
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=8, rotation=90 if len(labels) > 12 else 0)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _bar_width(runs: list[Run], per_bar: float, minimum: float) -> float:
    """Figure width that keeps bars readable however many runs there are."""
    return max(minimum, per_bar * len(runs) + 3)


def tier_breakdown(runs: list[Run], title: str) -> bytes:
    """Stacked bars per hierarchy run: share of accesses served by each tier, and missed."""
    tier_names = [n for n in _TIER_COLORS if n != "miss" and any(t.name == n for r in runs for t in r.tiers)]
    stacks = {f"{fmt.tier(name)} hit": [_tier_hits(r, name) / r.accesses if r.accesses else 0.0 for r in runs]
              for name in tier_names}
    stacks["miss"] = [r.miss_ratio for r in runs]
    colors = {f"{fmt.tier(n)} hit": _TIER_COLORS[n] for n in tier_names} | {"miss": _TIER_COLORS["miss"]}
    fig = Figure(figsize=(_bar_width(runs, 0.55, 7.0), 4.8), layout="constrained")
    ax = fig.add_subplot()
    _stacked_bars(ax, _bar_labels(runs), stacks, colors)
    for x, run in enumerate(runs):
        # Hit shares can be thin slivers under a tall miss bar: print the total on the bar.
        ax.text(x, run.hit_ratio + 0.01, f"{fmt.percent(run.hit_ratio)}\nhit", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, 1.0)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_ylabel("share of block accesses (%)")
    ax.set_xlabel("policy and total capacity (blocks)")
    ax.set_title(title, loc="left", fontsize=12)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    return _png(fig)


def _tier_hits(run: Run, name: str) -> int:
    return sum(t.hits for t in run.tiers if t.name == name)


def _component_colors(names: list[str]) -> dict[str, str]:
    palette = ["#3a6fb0", "#d9822b", "#2f8f46", "#b8423c", "#7b5ea7", "#8c6d31", "#d16ba5", "#5aa5b5"]
    colors = {name: palette[i % len(palette)] for i, name in enumerate(n for n in names if n != "recompute")}
    return colors | {"recompute": "#9a9a9a"}  # recompute is not a link: grey, the same in every plot


def data_movement(runs: list[Run], title: str) -> bytes:
    """Per run: bytes moved on each link (when any link moved data), and modeled seconds by component."""
    links = sorted({k for r in runs for k, v in r.bytes_moved.items() if v})
    parts = sorted({k for r in runs for k in r.modeled_seconds if k != "total"}, key=lambda k: (k == "recompute", k))
    panels = (["bytes"] if links else []) + (["time"] if parts else [])
    fig = Figure(figsize=(_bar_width(runs, 0.6 * len(panels), 6.0 * len(panels)), 4.8), layout="constrained")
    axes = dict(zip(panels, fig.subplots(1, len(panels), squeeze=False)[0]))
    if links:
        stacks = {link: [r.bytes_moved.get(link, 0) / 2**30 for r in runs] for link in links}
        _movement_panel(axes["bytes"], runs, stacks, "bytes moved per link", "bytes moved (GiB)", "link")
    if parts:
        stacks = {part: [r.modeled_seconds.get(part, 0.0) for r in runs] for part in parts}
        _movement_panel(axes["time"], runs, stacks, "modeled time by component", "modeled time (s)", "component")
    fig.suptitle(title, x=0.01, ha="left", fontsize=12)
    return _png(fig)


def _movement_panel(ax, runs: list[Run], stacks: dict[str, list[float]], title: str, ylabel: str, legend: str) -> None:
    _stacked_bars(ax, _bar_labels(runs), stacks, _component_colors(list(stacks)))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(4, len(stacks)), fontsize=8, frameon=False,
              title=legend, title_fontsize=8)


def prefix_savings(runs: list[Run], colors: dict[str, str], title: str) -> bytes:
    """Prefix semantics: share of prefill tokens and modeled time-to-first-token saved, against capacity."""
    with_ttft = any(r.ttft_saved_s is not None for r in runs)
    fig = Figure(figsize=(12 if with_ttft else 7.5, 4.6), layout="constrained")
    axes = fig.subplots(1, 2 if with_ttft else 1, squeeze=False)[0]
    for label in policy_labels(runs):
        mine = sorted((r for r in runs if r.label == label), key=lambda r: r.capacity_blocks)
        line, marker = ("--", "D") if is_offline(mine[0].policy) else ("-", "o")
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
