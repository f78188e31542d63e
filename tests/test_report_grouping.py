"""Which runs a report compares (probe B, F2, F6, F7): gap closed and the best online policy are
per tier layout, not per total capacity; the TTFT caption says what is subtracted; the payoff
sentence judges a prefix hierarchy by the TTFT it saves."""

from __future__ import annotations

import csv
from dataclasses import replace

import pytest

from tiercache.cli import main
from tiercache.config import Route
from tiercache.report.across import gap_rows, split_rows
from tiercache.report.model import from_documents
from tiercache.report.summary import best_per_capacity, gaps_for, hierarchy_payoffs
from tiercache.results import InstanceRecord, ResultsDocument
from test_report import ACCESSES, build, full_document, make_document, make_run, parse_page, table_with, write_json

# Two hierarchies of 40 blocks in all: (tiers, {policy: miss ratio}).
SPLIT_A = [("hbm", 5), ("dram", 35)]
SPLIT_B = [("hbm", 20), ("dram", 20)]
MISS_A = {"lru": 0.9, "arc": 0.85, "fifo": 0.88, "belady": 0.6}
MISS_B = {"lru": 0.9, "arc": 0.89, "fifo": 0.86, "belady": 0.8}


def tiered_run(policy: str, split: list[tuple[str, int]], miss_ratio: float, semantics: str = "object") -> dict:
    """A run over ``split`` (tier name, capacity), its hits all in the top tier."""
    hits = ACCESSES - round(miss_ratio * ACCESSES)
    tiers = [(name, cap, hits if i == 0 else 0) for i, (name, cap) in enumerate(split)]
    return make_run(policy, sum(cap for _, cap in split), miss_ratio, semantics, tiers=tiers)


def two_hierarchies(miss_a: dict = MISS_A, miss_b: dict = MISS_B, policies=("lru", "arc", "belady")) -> dict:
    """Runs of both hierarchies, interleaved by policy (as two sweeps merged in another order)."""
    runs = [tiered_run(p, split, miss[p]) for p in policies for split, miss in ((SPLIT_A, miss_a), (SPLIT_B, miss_b))]
    return make_document(runs=runs)


def runs_of(raw: dict):
    return from_documents([ResultsDocument.from_json(raw, "results.json")], ["results.json"]).runs


def by_split(runs) -> dict:
    return {(r.label, r.tiers[0].capacity_blocks): r for r in runs}


# F2: gap closed and the best online policy per tier layout


def test_gap_closed_is_against_the_references_of_the_same_hierarchy():
    runs = runs_of(two_hierarchies())
    gaps = gaps_for(list(runs))
    runs = by_split(runs)
    assert gaps[runs[("belady", 5)].key] == pytest.approx(1.0)
    assert gaps[runs[("belady", 20)].key] == pytest.approx(1.0)
    assert gaps[runs[("arc", 5)].key] == pytest.approx((0.9 - 0.85) / (0.9 - 0.6))
    assert gaps[runs[("arc", 20)].key] == pytest.approx((0.9 - 0.89) / (0.9 - 0.8))


def test_best_online_policy_has_one_entry_per_hierarchy():
    best = best_per_capacity(runs_of(two_hierarchies()))
    assert [(b.best.tiers[0].capacity_blocks, b.best.label) for b in best] == [(5, "arc"), (20, "arc")]
    assert [(b.lru.tiers[0].capacity_blocks, b.belady.miss_ratio) for b in best] == [(5, 0.6), (20, 0.8)]
    assert [b.gap_closed for b in best] == pytest.approx([0.05 / 0.3, 0.01 / 0.1])


def test_a_quantised_tier_is_another_cache():
    def int4(run):
        return replace(run, tiers=(replace(run.tiers[0], codec="int4"),))

    plain = runs_of(make_document(runs=[make_run(p, 100, m) for p, m in (("lru", 0.9), ("arc", 0.8), ("belady", 0.6))]))
    quantised = runs_of(make_document(runs=[make_run(p, 100, m) for p, m in (("lru", 0.9), ("arc", 0.8), ("belady", 0.7))]))
    best = best_per_capacity(list(plain) + [int4(r) for r in quantised])
    assert {b.best.tiers[0].codec: b.belady.miss_ratio for b in best} == {"none": 0.6, "int4": 0.7}


def test_report_best_table_csv_and_findings_have_one_row_per_hierarchy(tmp_path):
    first = make_document(runs=[tiered_run(p, SPLIT_A, MISS_A[p]) for p in ("lru", "arc", "belady")])
    second = make_document(runs=[tiered_run(p, SPLIT_B, MISS_B[p]) for p in ("lru", "arc", "belady")])
    out = tmp_path / "report"
    assert main(["report", write_json(tmp_path / "a.json", first), write_json(tmp_path / "b.json", second),
                 "-o", str(out)]) == 0
    rows = table_with(parse_page(out), "best online policy")
    assert [(r["tiers (blocks)"], r["belady miss ratio"], r["gap closed"]) for r in rows] == [
        ("HBM 5 + DRAM 35", "60.00%", "16.7%"), ("HBM 20 + DRAM 20", "80.00%", "10.0%")]
    markdown = (out / "report.md").read_text()
    assert "- In HBM 5 + DRAM 35 blocks (object semantics, exclusive hierarchy), arc misses 85.0%" in markdown
    csv_rows = list(csv.DictReader((out / "results.csv").open(encoding="utf-8")))
    gaps = {(r["policy"], r["hbm_capacity_blocks"]): float(r["gap_closed"]) for r in csv_rows}
    assert gaps[("belady", "5")] == gaps[("belady", "20")] == pytest.approx(1.0)
    assert gaps[("arc", "20")] == pytest.approx(0.1)


def test_single_tier_best_table_needs_no_tiers_column(tmp_path):
    rows = table_with(parse_page(build(tmp_path, make_document())), "best online policy")
    assert rows and "tiers (blocks)" not in rows[0]


def test_runs_of_one_hierarchy_are_listed_together():
    runs = runs_of(two_hierarchies())
    assert [(r.label, r.tiers[0].capacity_blocks) for r in runs] == [
        ("lru", 5), ("arc", 5), ("belady", 5), ("lru", 20), ("arc", 20), ("belady", 20)]


def test_across_has_one_row_per_hierarchy(tmp_path, capsys):
    path = write_json(tmp_path / "h.json", two_hierarchies())
    assert main(["report", "--across", path, "-o", str(tmp_path / "gaps")]) == 0
    table = capsys.readouterr().out
    assert "| 40 | HBM 5 + DRAM 35 | 0.900000 | 0.600000 | arc | 0.850000 | 16.7% |" in table
    assert "| 40 | HBM 20 + DRAM 20 | 0.900000 | 0.800000 | arc | 0.890000 | 10.0% |" in table
    assert len(gap_rows(ResultsDocument.from_json(two_hierarchies(), "h.json"))) == 2


def test_split_names_each_hierarchys_own_winner():
    policies = ("lru", "arc", "fifo", "belady")
    tune = ResultsDocument.from_json(two_hierarchies(policies=policies), "tune.json")
    test = ResultsDocument.from_json(two_hierarchies(MISS_B, MISS_A, policies=policies), "test.json")
    rows = split_rows(tune, test)
    assert [r.tuned for r in rows] == ["arc", "fifo"]
    assert [(r.tiers, r.tuned) for r in rows] == [("HBM 5 + DRAM 35", "arc"), ("HBM 20 + DRAM 20", "fifo")]
    # On the second half HBM 5 + DRAM 35 has MISS_B: arc 0.89 against lru 0.9, belady 0.8.
    assert rows[0].tuned_miss == 0.89 and rows[0].tuned_gap == pytest.approx(0.1)
    assert rows[1].tuned_miss == 0.88 and rows[1].tuned_gap == pytest.approx(0.02 / 0.3)


# F6: the TTFT caption says what is subtracted


def test_ttft_caption_names_the_loads_not_every_transfer(tmp_path):
    markdown = (build(tmp_path, full_document()) / "report.md").read_text()
    assert "every transfer the cache made" not in markdown
    assert ("prefill time of the saved tokens minus the modeled time of the loads (every transfer from a slower "
            "tier towards HBM, counted in full); write-backs and demotions run off the TTFT path and are not "
            "subtracted") in markdown


# F7: a prefix hierarchy pays off by the TTFT it saves


def prefix_pair(ttft_alone: float, ttft_tiered: float) -> list[dict]:
    """HBM 100 alone and HBM 100 + DRAM 400 in prefix semantics; the hierarchy's total modeled
    time (write-backs included) is higher than HBM alone's."""
    alone = make_run("lru", 100, 0.9, "prefix")
    tiered = tiered_run("lru", [("hbm", 100), ("dram", 400)], 0.5, "prefix")
    alone |= {"ttft_saved_s": ttft_alone, "modeled_seconds": {"recompute": 160.0, "total": 160.0}}
    tiered |= {"ttft_saved_s": ttft_tiered,
               "modeled_seconds": {"dram->hbm": 2.0, "hbm->dram": 300.0, "recompute": 90.0, "total": 392.0}}
    return [alone, tiered]


def test_prefix_hierarchy_that_saves_more_ttft_pays_off_despite_write_backs(tmp_path):
    markdown = (build(tmp_path, make_document(runs=prefix_pair(1.55, 4.22))) / "report.md").read_text()
    assert "- lru: the hierarchy pays off: it cuts misses from 90.0% to 50.0% and raises modeled TTFT saved " \
           "from 1.55 s to 4.22 s." in markdown
    assert "Judged by modeled TTFT saved: prefill time of the saved tokens minus" in markdown
    assert "modeled time rises" not in markdown


def test_prefix_hierarchy_that_saves_less_ttft_does_not_pay_off(tmp_path):
    markdown = (build(tmp_path, make_document(runs=prefix_pair(4.0, 3.0))) / "report.md").read_text()
    assert "- lru: the hierarchy does not pay off: it cuts misses from 90.0% to 50.0%, but modeled TTFT saved " \
           "falls from 4.00 s to 3.00 s." in markdown


def test_object_payoff_says_what_modeled_time_counts(tmp_path):
    runs = [make_run("lru", 100, 0.9), tiered_run("lru", [("hbm", 100), ("dram", 400)], 0.5)]
    markdown = (build(tmp_path, make_document(runs=runs)) / "report.md").read_text()
    assert "same policy. Judged by modeled request time: the recompute time of the misses plus the loads (every " \
           "transfer from a slower tier towards HBM, counted in full); write-backs and demotions run in the background, " \
           "each on its own link beside the requests, and count only where one link is busy longer than that (the " \
           "requests then wait for it)." in markdown


def test_a_fleet_run_is_not_paired_with_hbm_alone():
    alone, tiered = runs_of(make_document(runs=[make_run("lru", 100, 0.9, "prefix"),
                                                tiered_run("lru", [("hbm", 100), ("remote", 400)], 0.5, "prefix")]))
    instance = InstanceRecord(0, 1, tiered.accesses, tiered.hits, tiered.misses, {"hbm": tiered.hits}, {}, {}, 0, tiered.ttft_saved_s)
    fleet = replace(tiered, instances=(instance,), route=Route.ROUND_ROBIN)
    assert len(hierarchy_payoffs([alone, tiered])) == 1
    assert hierarchy_payoffs([alone, fleet]) == []
