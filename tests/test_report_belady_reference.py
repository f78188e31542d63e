"""Belady is the bound only where it is the offline optimum (probe D, F1), and the manager's
docstring claims no miss count it does not have (probe D, F3).

Belady's MIN is the optimum of one tier in object semantics only: in prefix semantics and in
hierarchies a policy can miss less than Belady's replay. Reports there call it a reference,
print a gap closed above 100% as it is, marked, with a note, and keep "the bound" for single-tier
object caches.
"""

from __future__ import annotations

import re

from tiercache.cli import main
from tiercache.config import TierConfig
from tiercache.core import manager
from tiercache.report import plots
from tiercache.report.across import GapRow, gap_markdown
from tiercache.report import summary
from tiercache.results import Semantics
from tiercache.sim.loader import load_trace
from tiercache.sim.replay import ReplayData, RunSpec, replay
from tiercache.sim.traces import Request, write_requests
from test_report import build, make_document, make_run, parse_page, table_with, write_json
from test_report_grouping import runs_of, tiered_run

# The probe's 4-request prefix trace at 2 blocks: lru 6 misses of 8, belady 5, arc 4.
PREFIX_MISS = {"lru": 0.75, "belady": 0.625, "arc": 0.5}
# The probe's 3-tier trace (HBM 2 + DRAM 2 + NVMe 2): lru 7 misses of 17, belady 8.
TIERS = [("hbm", 2), ("dram", 2), ("nvme", 2)]
TIER_MISS = {"lru": 7 / 17, "belady": 8 / 17}
BOUND_CLAIMS = ("no policy can miss less: it is the bound", "is the best any policy could do")


def prefix_document() -> dict:
    return make_document(runs=[make_run(p, 2, m, "prefix") for p, m in PREFIX_MISS.items()])


def hierarchy_document() -> dict:
    return make_document(runs=[tiered_run(p, TIERS, m) for p, m in TIER_MISS.items()])


def summary_text(out) -> str:
    return (out / "report.md").read_text()


def test_belady_is_the_bound_only_in_one_tier_in_object_semantics():
    runs = runs_of(make_document(runs=[make_run("belady", 2, 0.5), make_run("belady", 2, 0.5, "prefix"),
                                       tiered_run("belady", TIERS, 0.5)]))
    assert {(r.semantics.value, r.is_hierarchy): summary.belady_is_bound(r) for r in runs} == {
        ("object", False): True, ("prefix", False): False, ("object", True): False}


def test_prefix_report_calls_belady_a_reference_and_shows_a_gap_above_100_percent(tmp_path):
    out = build(tmp_path, prefix_document())
    text = summary_text(out)
    for claim in BOUND_CLAIMS:
        assert claim not in text
    assert "In prefix semantics, belady is a reference, Belady's replay, which a policy may beat" in text
    assert ("closing 200.0% of the lru–belady gap; it misses less than belady's replay, which is no bound here "
            "(Belady's MIN is the offline optimum only in one tier in object semantics).") in text
    assert "is Belady's replay, in prefix semantics a reference a policy can beat, not the best any policy could do" in text
    page = parse_page(out)
    best = table_with(page, "best online policy")
    assert [(r["best online policy"], r["gap closed"]) for r in best] == [("arc", "200.0% (beats belady)")]
    runs = {r["policy"]: r["gap closed"] for r in table_with(page, "tiers (blocks)")}
    assert runs == {"lru": "0.0%", "belady": "100.0%", "arc": "200.0% (beats belady)"}
    html = (out / "index.html").read_text()
    captions = re.findall(r"<caption>([^<]*)</caption>", html)
    assert sum("missed less than belady&#x27;s replay, which is the offline optimum only in one tier" in c
               for c in captions) == 2  # the best table's and the runs table's


def test_object_single_tier_report_keeps_the_bound(tmp_path):
    out = build(tmp_path, make_document())
    text = summary_text(out)
    for claim in BOUND_CLAIMS:
        assert claim in text
    assert "beats belady" not in text and "Belady's replay" not in text


def test_mixed_report_limits_the_bound_to_object_semantics(tmp_path):
    runs = [make_run(p, 2, m) for p, m in (("lru", 0.8), ("arc", 0.7), ("belady", 0.6))]
    out = build(tmp_path, make_document(runs=runs + prefix_document()["runs"]))
    text = summary_text(out)
    assert "but in one tier in object semantics no policy can miss less: there it is the bound." in text
    assert ("is Belady's replay: in object semantics the best any policy could do, in prefix semantics a reference "
            "a policy can beat") in text


def test_hierarchy_where_lru_beats_belady_says_so(tmp_path):
    out = build(tmp_path, hierarchy_document())
    text = summary_text(out)
    assert "it is the bound" not in text
    assert "In a hierarchy, MIN in each tier (with promotions and demotions) is not the optimum of the whole." in text
    assert re.search(r"lru misses 41\.2% of accesses \(vs belady 47\.1%\); no other online policy beats lru here; "
                     r"it misses less than belady's replay, which is no bound here", text)
    assert "belady's hatched bar is Belady's replay (MIN in each tier), a reference a policy can beat" in text
    [entry] = summary.best_per_capacity(runs_of(hierarchy_document()))
    assert entry.gap_closed is None and entry.beats_belady


def test_offline_legend_says_the_bound_only_where_it_is():
    runs = runs_of(make_document(runs=[make_run("belady", 2, 0.5), make_run("belady", 2, 0.5, "prefix"),
                                       tiered_run("belady", TIERS, 0.5)]))
    labels = {(r.semantics.value, r.is_hierarchy): plots._offline_label(r) for r in runs}
    reference = "belady (Belady's replay: a reference, not a bound)"
    assert labels == {("object", False): "belady (offline optimum: the bound)", ("prefix", False): reference,
                      ("object", True): reference}


def test_gaps_md_prints_a_gap_above_100_percent_with_a_note(tmp_path, capsys):
    out = tmp_path / "gaps"
    assert main(["report", "--across", write_json(tmp_path / "p.json", prefix_document()), "-o", str(out)]) == 0
    gaps = (out / "gaps.md").read_text()
    assert "| arc | 0.500000 | 200.0% (beats belady) |" in gaps
    assert "Note: a gap closed above 100% (or a miss ratio below belady's) means the policy missed less than" in gaps
    assert gaps.endswith(capsys.readouterr().out)


def test_gap_table_without_a_policy_beating_belady_has_no_note():
    row = GapRow("t", "object", "single", 2, "HBM 2", 0.8, 0.6, "arc", 0.7, 0.5)
    assert "Note" not in gap_markdown([row]) and "| 50.0% |" in gap_markdown([row])
    split = GapRow("t", "prefix", "single", 2, "HBM 2", 0.75, 0.625, "lru", 0.75, None, "arc", 0.5, 2.0)
    assert "| arc | 0.500000 | 200.0% (beats belady) |" in gap_markdown([split]) and "Note:" in gap_markdown([split])


def test_hierarchy_misses_are_not_those_of_one_lru_of_its_total_size(tmp_path):
    """What the manager's docstring now says: an exclusive LRU hierarchy need not miss as often
    as one LRU of its total size (it used to claim they are equal on the sample trace)."""
    path = tmp_path / "t.jsonl"
    write_requests(str(path), [Request(10 * i, 512, 4, (block,)) for i, block in enumerate((4, 0, 1, 4, 3, 4))])
    data = ReplayData.prepare(load_trace(str(path)), None, None)
    misses = {shape: replay(RunSpec("lru", Semantics.OBJECT, tuple(TierConfig(n, c) for n, c in shape)), data).misses
              for shape in ((("hbm", 1), ("dram", 1), ("nvme", 1)), (("hbm", 3),))}
    assert len(set(misses.values())) == 2
    doc = " ".join(manager.__doc__.split())
    assert "equals a single LRU" not in doc and "need not miss as often as that LRU" in doc
