"""The fleet report: per-instance and shared-tier hits of a fleet replay, against the same
fleet on private tiers alone (``tiercache fleet --report DIR``).

Works from the plain results dicts ``tiercache.sim.fleet.replay_fleet`` returns (the JSON
``tiercache fleet --json`` writes): a Markdown page with the tables and one PNG plot.
"""

from __future__ import annotations

import io
import os

from matplotlib.figure import Figure

__all__ = ["fleet_table", "fleet_markdown", "fleet_plot", "write_fleet_report", "gain_sentence"]

_SHADES = {"hbm": "#1f4e79", "dram": "#5b9bd5", "nvme": "#a9c9ea", "remote": "#e07b39"}


def fleet_table(result: dict) -> list[list[str]]:
    """Rows ``instance, requests, <tier> hits..., misses, hit ratio[, remote GiB in, TTFT
    saved s]`` plus a total row (the last two with bytes, and with a hardware profile)."""
    tiers = list(result["tiers"]) + (["remote"] if result["remote_blocks"] else [])
    rows_in = result["instances"]
    with_bytes = result["remote_blocks"] and rows_in and rows_in[0]["bytes_moved"] is not None
    with_time = rows_in and rows_in[0].get("ttft_saved_s") is not None
    rows = [["instance", "requests", *[f"{t} hits" for t in tiers], "misses", "hit ratio"]
            + (["remote GiB in"] if with_bytes else []) + (["TTFT saved s"] if with_time else [])]

    def extra(bytes_in: float, ttft: float | None) -> list[str]:
        return ([f"{bytes_in / 2**30:.1f}"] if with_bytes else []) + ([f"{ttft:.1f}"] if with_time else [])

    for r in rows_in:
        ratio = r["hits"] / r["accesses"] if r["accesses"] else 0.0
        rows.append([str(r["instance"]), str(r["requests"]), *[str(r["tier_hits"].get(t, 0)) for t in tiers],
                     str(r["misses"]), f"{ratio:.4f}", *extra(_remote_in(r), r.get("ttft_saved_s"))])
    totals = [sum(r["tier_hits"].get(t, 0) for r in rows_in) for t in tiers]
    rows.append(["all", str(sum(r["requests"] for r in rows_in)), *map(str, totals), str(sum(r["misses"] for r in rows_in)),
                 f"{result['hit_ratio']:.4f}", *extra(sum(_remote_in(r) for r in rows_in), result.get("ttft_saved_s"))])
    return rows


def _remote_in(row: dict) -> float:
    """Bytes an instance read from the shared tier."""
    return sum(v for k, v in (row["bytes_moved"] or {}).items() if k.startswith("remote->"))


def gain_sentence(shared: dict, private: dict) -> str:
    """What the shared tier adds over the same fleet's private tiers alone."""
    extra = shared["hits"] - private["hits"]
    relative = extra / private["hits"] if private["hits"] else float("inf")
    sentence = (f"The shared tier ({shared['remote_blocks']} blocks) serves {shared['shared_hits']} hits; with it the fleet "
                f"reuses {shared['hits']} blocks (hit ratio {shared['hit_ratio']:.4f}) against {private['hits']} "
                f"({private['hit_ratio']:.4f}) on private tiers alone: {extra:+d} blocks ({relative:+.1%}), "
                f"{shared['prefill_tokens_saved'] - private['prefill_tokens_saved']:+,d} prefill tokens saved.")
    if shared.get("ttft_saved_s") is not None:
        sentence += (f" Modeled TTFT saved ({shared['hardware']}): {shared['ttft_saved_s']:.1f} s against "
                     f"{private['ttft_saved_s']:.1f} s.")
    return sentence


def _markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def fleet_markdown(shared: dict, private: dict, command: str) -> str:
    """The report page: the setting, both tables and the gain."""
    tiers = ", ".join(f"{k}={v}" for k, v in shared["tiers"].items())
    return "\n\n".join([
        f"# Fleet replay: {len(shared['instances'])} instances, {shared['route']}, {shared['policy']}",
        f"Private tiers per instance: {tiers}; shared remote tier: {shared['remote_blocks']} blocks. "
        f"Prefix semantics; remote writes through. Command: `{command}`",
        "## With the shared tier", _markdown_table(fleet_table(shared)),
        "## Private tiers alone", _markdown_table(fleet_table(private)),
        "## Gain", gain_sentence(shared, private),
        "![per-instance hits](fleet.png)",
    ]) + "\n"


def fleet_plot(shared: dict, private: dict) -> bytes:
    """Stacked bars per instance: hits per local tier and from the shared tier, beside the
    private-only run's hits (hatched)."""
    figure = Figure(figsize=(7, 3.6), dpi=110)
    axes = figure.add_subplot()
    tiers = list(shared["tiers"]) + ["remote"]
    for index, (with_shared, alone) in enumerate(zip(shared["instances"], private["instances"])):
        bottom = 0
        for tier in tiers:
            value = with_shared["tier_hits"].get(tier, 0)
            axes.bar(index - 0.2, value, 0.38, bottom=bottom, color=_SHADES.get(tier, "#888"), label=tier if index == 0 else None)
            bottom += value
        axes.bar(index + 0.2, alone["hits"], 0.38, color="white", edgecolor="#444", hatch="//",
                 label="private tiers alone" if index == 0 else None)
    axes.set_xticks(range(len(shared["instances"])), [f"instance {r['instance']}" for r in shared["instances"]])
    axes.set_ylabel("blocks reused (hits)")
    axes.legend(fontsize=8, frameon=False)
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png")
    return out.getvalue()


def write_fleet_report(shared: dict, private: dict, out_dir: str | os.PathLike, command: str) -> str:
    """Writes ``report.md`` and ``fleet.png`` into ``out_dir``; returns the Markdown path."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "fleet.png"), "wb") as handle:
        handle.write(fleet_plot(shared, private))
    path = os.path.join(out_dir, "report.md")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(fleet_markdown(shared, private, command))
    return path
