"""Report details (issue 8 items 13 and 20): one colour per policy in every plot, hierarchies drawn
as what they are, wide tables in a scroll box, the HBM-only payoff sentence, the hit split per tier."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from matplotlib.colors import to_hex, to_rgb
from matplotlib.patches import Rectangle

from tiercache.cli import main
from tiercache.report import content, plots
from tiercache.report.model import from_documents
from tiercache.results import ResultsDocument
from test_report import ACCESSES, MISS, build, full_document, make_document, make_run, parse_page, table_with

TRACE = str(Path(__file__).parent / "data" / "mooncake_head.jsonl")


def hierarchy_run(policy: str, hbm: int, miss_ratio: float, seconds: float | None = None) -> dict:
    """A version-1 three-tier run with ``hbm`` blocks on top (DRAM 4×, NVMe 11×)."""
    hits = ACCESSES - round(miss_ratio * ACCESSES)
    split = [("hbm", hbm, hits // 2), ("dram", 4 * hbm, hits // 3), ("nvme", 11 * hbm, hits - hits // 2 - hits // 3)]
    run = make_run(policy, 16 * hbm, miss_ratio, tiers=split)
    if seconds is not None:
        run["modeled_seconds"] = {"dram->hbm": 0.02, "recompute": seconds - 0.02, "total": seconds}
    return run


@pytest.fixture
def captured(monkeypatch) -> dict[str, list]:
    """Every plot function's figure and arguments, by function name, while building a document."""
    figures: list = []
    monkeypatch.setattr(plots, "_png", lambda fig: figures.append(fig) or b"png")
    calls: dict[str, list] = {}
    for name in ("miss_ratio_curves", "hierarchy_miss_ratios", "tier_breakdown", "data_movement", "prefix_savings"):
        original = getattr(plots, name)

        def spy(*args, _name=name, _original=original):
            result = _original(*args)
            calls.setdefault(_name, []).append((args, figures[-1]))
            return result

        monkeypatch.setattr(plots, name, spy)
    return calls


def document_of(raw: dict):
    data = from_documents([ResultsDocument.from_json(raw, "results.json")], ["results.json"])
    return data, content.build_document(data, None, "tiercache report results.json")


def colors_arg(args: tuple) -> dict[str, str]:
    return next(a for a in args if isinstance(a, dict) and "lru" in a)


def bars(fig) -> list[Rectangle]:
    return [p for ax in fig.axes for p in ax.patches if isinstance(p, Rectangle) and p.get_height() > 0]


def test_every_plot_gets_the_one_policy_colour_map(captured):
    data, _ = document_of(full_document())
    assert set(captured) == {"miss_ratio_curves", "hierarchy_miss_ratios", "tier_breakdown", "data_movement", "prefix_savings"}
    maps = [colors_arg(args) for calls in captured.values() for args, _ in calls]
    assert all(m == maps[0] for m in maps)
    online = [c for label, c in maps[0].items() if label != "belady"]
    assert len(set(online)) == len(online), "two policies share a colour"


def test_bars_are_drawn_in_their_policy_colour_and_shades_of_it(captured):
    document_of(full_document())
    for name in ("tier_breakdown", "data_movement"):
        (args, fig), = captured[name]
        colors, runs = colors_arg(args), args[0]
        ax = fig.axes[0]
        for x, run in enumerate(runs):
            mine = [p for p in bars(fig) if p.axes is ax and abs(p.get_x() + p.get_width() / 2 - x) < 1e-9]
            assert to_hex(mine[0].get_facecolor()) == colors[run.label]  # the fastest tier / first link: full colour
            for patch in mine[1:]:
                assert _is_shade_of(patch.get_facecolor(), colors[run.label]) or _is_grey(patch.get_facecolor())


def _is_shade_of(rgba, color: str) -> bool:
    """``rgba`` is ``color`` blended towards white (the same hue, lighter)."""
    base, face = to_rgb(color), rgba[:3]
    amounts = {round((f - b) / (1 - b), 3) for f, b in zip(face, base) if b < 0.99}
    return len(amounts) == 1 and 0 <= amounts.pop() < 1


def _is_grey(rgba) -> bool:
    return max(rgba[:3]) - min(rgba[:3]) < 0.02


def test_curves_use_the_policy_colours(captured):
    document_of(full_document())
    for args, fig in captured["miss_ratio_curves"]:
        colors = colors_arg(args)
        for line in fig.axes[0].get_lines():
            label = line.get_label().split(" ")[0]
            if label in colors:
                assert to_hex(line.get_color()) == colors[label]


def test_a_hierarchy_is_bars_per_policy_labelled_with_its_tiers(captured):
    document_of(full_document())
    (args, fig), = captured["hierarchy_miss_ratios"]
    runs, colors = args[0], colors_arg(args)
    ax = fig.axes[0]
    assert all(len(line.get_xdata()) != 1 or line.get_linestyle() == "None" for line in ax.get_lines())
    assert sorted(to_hex(p.get_facecolor()) for p in bars(fig)) == sorted(colors[r.label] for r in runs)
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["HBM 100\nDRAM 400\nNVMe 1,100\n(total 1,600 = 100 GiB)"]
    assert {t.get_text() for t in ax.texts} == {"50.0%", "40.0%"}  # each bar says its miss ratio


def test_several_hierarchies_are_one_group_each(captured):
    runs = [hierarchy_run(p, hbm, MISS[p][i]) for i, hbm in enumerate((10, 40)) for p in ("lru", "belady")]
    _, document = document_of(make_document(runs=runs))
    (args, fig), = captured["hierarchy_miss_ratios"]
    assert [t.get_text().split("\n")[0] for t in fig.axes[0].get_xticklabels()] == ["HBM 10", "HBM 40"]
    assert len(bars(fig)) == 4
    image = next(i for i in document.images() if i.filename == "miss_ratio_object_exclusive.png")
    assert "grouped by hierarchy (2 hierarchies)" in image.caption


def test_a_single_hierarchy_says_there_is_no_curve(tmp_path):
    markdown = (build(tmp_path, full_document()) / "report.md").read_text()
    assert "Miss ratio per hierarchy" in markdown
    assert "Only one hierarchy was run, so there is no curve" in markdown
    assert "Miss-ratio curves: object semantics, exclusive" not in markdown


def test_a_policy_at_one_capacity_is_a_point_in_the_legend(captured):
    runs = [make_run(p, 100, MISS[p][0]) for p in ("lru", "s3fifo", "belady")]
    document_of(make_document(runs=runs))
    (_, fig), = captured["miss_ratio_curves"]
    assert all(line.get_linestyle() == "None" for line in fig.axes[0].get_legend().get_lines()[:3])


def test_every_html_table_sits_in_a_horizontal_scroll_box(tmp_path):
    html = (build(tmp_path, full_document()) / "index.html").read_text()
    assert re.search(r"\.table-wrap \{[^}]*overflow-x: auto", html)
    tables = html.count("<table>")
    assert tables >= 4 and len(re.findall(r'<div class="table-wrap"[^>]*><table>', html)) == tables
    assert re.search(r"th \{[^}]*white-space: normal", html)  # headers wrap before the box scrolls
    assert '<td class="wrap">HBM 100 + DRAM 400 + NVMe 1,100</td>' in html


def test_payoff_sentence_when_hbm_alone_ran_too(tmp_path):
    markdown = (build(tmp_path, full_document()) / "report.md").read_text()
    assert ("The hierarchy HBM 100 + DRAM 400 + NVMe 1,100 blocks (object semantics, exclusive hierarchy) against "
            "HBM 100 blocks alone") in markdown
    # lru alone at 100 blocks: 90% misses, 0.02 + 9,000 × 0.018 s; the hierarchy: 50%, 0.02 + 5,000 × 0.018 s.
    assert "- lru: the hierarchy pays off: it cuts misses from 90.0% to 50.0% and modeled request time from 162 s to 90.02 s." \
        in markdown
    assert "- belady: the hierarchy pays off: it cuts misses from 60.0% to 40.0%" in markdown


def test_payoff_sentence_says_when_the_hierarchy_does_not_pay_off(tmp_path):
    runs = [make_run("lru", 100, 0.9), hierarchy_run("lru", 100, 0.5, seconds=500.0)]
    markdown = (build(tmp_path, make_document(runs=runs)) / "report.md").read_text()
    assert ("- lru: the hierarchy does not pay off: it cuts misses from 90.0% to 50.0%, but modeled request time rises "
            "from 162 s to 500 s.") in markdown


@pytest.mark.parametrize("runs", [
    None,  # single tiers only
    [hierarchy_run("lru", 100, 0.5)],  # a hierarchy only
    [make_run("lru", 400, 0.7), hierarchy_run("lru", 100, 0.5)],  # HBM alone at another capacity
    [make_run("fifo", 100, 0.9), hierarchy_run("lru", 100, 0.5)],  # another policy
], ids=["no-hierarchy", "no-hbm-only", "other-capacity", "other-policy"])
def test_no_payoff_sentence_without_a_matching_pair(tmp_path, runs):
    markdown = (build(tmp_path, make_document(runs=runs)) / "report.md").read_text()
    assert "pay off" not in markdown


@pytest.fixture(scope="module")
def tiered_report(tmp_path_factory) -> tuple[dict, Path]:
    """A real schema-3 replay of a hierarchy (with bytes and modeled times) and its report."""
    folder = tmp_path_factory.mktemp("tiered")
    results = folder / "h.json"
    argv = ["replay", TRACE, "--policy", "lru,belady", "--tiers", "hbm=50,dram=200,nvme=800", "--model", "llama-3-8b",
            "--hardware", "h200-pcie5-nvme4", "--no-progress", "--out", str(results)]
    assert main(argv) == 0
    assert main(["report", str(results), "-o", str(folder / "report")]) == 0
    return json.loads(results.read_text()), folder / "report"


def test_per_tier_table_shows_hits_in_place_and_promoted(tiered_report):
    raw, out = tiered_report
    rows = table_with(parse_page(out), "read in place")
    assert len(rows) == sum(len(run["tiers"]) for run in raw["runs"])
    nvme = next(t for t in raw["runs"][0]["tiers"] if t["name"] == "nvme")
    row = next(r for r in rows if r["policy"] == "lru" and r["tier"] == "NVMe")
    assert (row["read in place"], row["promoted"]) == (f"{nvme['hits_in_place']:,}", f"{nvme['hits_promoted']:,}")
    assert nvme["hits_promoted"] > 0 and row["promoted bytes"].endswith("B") and row["promoted time"].endswith(" s")
    markdown = (out / "report.md").read_text()
    assert "| policy | semantics | hierarchy | tier | capacity (blocks) | hits | read in place | promoted |" in markdown


def test_csv_carries_the_hit_split_exactly(tiered_report):
    raw, out = tiered_report
    rows = list(csv.DictReader((out / "results.csv").open(encoding="utf-8")))
    for run, row in zip(raw["runs"], rows):
        for tier in run["tiers"]:
            for field in ("hits_in_place", "hits_promoted", "in_place_bytes", "promoted_bytes"):
                assert int(row[f"{tier['name']}_{field}"]) == tier[field]
            for field in ("in_place_seconds", "promoted_seconds"):
                assert float(row[f"{tier['name']}_{field}"]) == tier[field]


def test_older_results_say_not_recorded(tmp_path):
    out = build(tmp_path, full_document())  # version-1 documents: no hit split
    rows = table_with(parse_page(out), "read in place")
    assert rows and all(r["read in place"] == r["promoted time"] == "not recorded" for r in rows)
    assert "| not recorded | not recorded |" in (out / "report.md").read_text()
    csv_rows = list(csv.DictReader((out / "results.csv").open(encoding="utf-8")))
    tiered = [r for r in csv_rows if r["mode"] == "exclusive"]
    assert tiered and all(r["dram_hits_in_place"] == "" for r in tiered)  # empty cell: not recorded, never 0
