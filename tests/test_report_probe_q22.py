"""The report's fleet section against probe Q22 (findings 3 and 4).

3. The section wrote one table row and drew one bar and tick label per instance (20,000
   instances: 145 s, 1.4 GB and a plot of smeared labels): above ``LISTED_INSTANCES`` it now
   summarises (min, median and max per column, the extreme instances, all) and plots the
   ranked hits.
4. A one-engine results file whose profile carried network links was refused beside a fleet
   file for "its shared tier's network", though it has no shared tier: only files with fleet
   runs over a shared tier are compared, and by their network links.
"""

from __future__ import annotations

import json
import statistics
import warnings
from pathlib import Path

from tiercache.cli import main
from tiercache.report.fleet import EXTREMES, LISTED_INSTANCES
from tiercache.results import read_results
from tiercache.sim.hardware import PRESETS
from test_cli_errors import _error  # runs the CLI, asserts exit 2 with one line

DATA = Path(__file__).parent / "data"
HEAD = DATA / "mooncake_head.jsonl"


def _fleet_table(report: str, caption_start: str) -> list[list[str]]:
    """The body rows (cells) of report.md's first table captioned ``caption_start...``."""
    lines = report.splitlines()
    end = next(n for n, line in enumerate(lines) if line.lstrip("*").startswith(caption_start))
    while not lines[end - 1].startswith("|"):
        end -= 1  # the blank line between a table and its caption
    start = end
    while lines[start - 1].startswith("|"):
        start -= 1
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[start + 2 : end]]


def test_a_fleet_of_many_instances_is_summarised_in_the_report_not_listed_one_by_one(tmp_path, recwarn):
    instances = 10 * LISTED_INSTANCES
    out = tmp_path / "many.json"
    assert main(["replay", str(DATA / "mooncake_synthetic_trace.jsonl"), "--instances", str(instances), "--tiers",
                 "hbm=10,remote=50", "--model",
                 "llama-3-8b", "--out", str(out), "--no-progress"]) == 0
    shared = next(r for r in read_results(out).runs if any(t.name == "remote" for t in r.tiers))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "loc='best' can be slow" included
        assert main(["report", str(out), "-o", str(tmp_path / "r")]) == 0
    report = (tmp_path / "r" / "report.md").read_text()
    rows = _fleet_table(report, "Hits per instance and tier")
    assert [r[0] for r in rows[:3]] == ["min", "median", "max"] and rows[-1][0] == "all"
    assert len(rows) == 3 + 2 * EXTREMES + 1  # not one row per instance
    ratios = [r.hits / r.accesses for r in shared.instances]
    assert [r[5] for r in rows[:3]] == [f"{v:.4f}" for v in (min(ratios), statistics.median(ratios), max(ratios))]
    named = [int(r[0]) for r in rows[3:-1]]
    by_ratio = sorted(shared.instances, key=lambda r: (r.hits / r.accesses, r.instance))
    assert named == [r.instance for r in by_ratio[:EXTREMES] + by_ratio[-EXTREMES:]]
    assert f"{instances:,} instances, more than the {LISTED_INSTANCES} listed one by one" in report
    links = _fleet_table(report, "GiB moved per link")
    assert [r[0] for r in links] == ["min", "median", "max", "all"]
    assert len(_fleet_table(report, "The same fleet on private tiers alone")) == len(rows)
    assert (tmp_path / "r" / "fleet_1.png").stat().st_size > 1000
    # a fleet of at most LISTED_INSTANCES instances is still listed, one row each
    assert main(["replay", str(HEAD), "--instances", "4", "--tiers", "hbm=10,remote=50", "--out", str(tmp_path / "few.json"),
                 "--no-progress"]) == 0
    assert main(["report", str(tmp_path / "few.json"), "-o", str(tmp_path / "f")]) == 0
    few = _fleet_table((tmp_path / "f" / "report.md").read_text(), "Hits per instance and tier")
    assert [r[0] for r in few] == ["0", "1", "2", "3", "all"]


def _profile(path: Path, name: str, network_bps: float) -> Path:
    """A profile JSON of the h200-pcie5-nvme4 machine whose own network links run at ``network_bps``."""
    machine = PRESETS["h200-pcie5-nvme4"]
    links = {n: {"bandwidth_Bps": link.bandwidth_Bps, "latency_s": link.latency_s} for n, link in machine.links.items()}
    links["remote->dram"] = links["dram->remote"] = {"bandwidth_Bps": network_bps, "latency_s": 5e-6}
    path.write_text(json.dumps({"name": name, "links": links, "prefill_tokens_per_s": machine.prefill_tokens_per_s}))
    return path


def test_only_files_with_a_shared_tier_are_held_to_one_network(tmp_path, capsys):
    trace = tmp_path / "a.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(r), "output_length": 1, "hash_ids": r})
                             + "\n" for i, r in enumerate([[1, 2], [1, 2, 3], [1, 2, 3]])))
    hardware = ["--model", "llama-3-8b", "--hardware"]
    fleet, one, other = tmp_path / "fleet.json", tmp_path / "one.json", tmp_path / "other.json"
    assert main(["replay", str(trace), "--instances", "2", "--tiers", "hbm=2,remote=4", *hardware, "h200-pcie5-nvme4",
                 "--network", "rdma-200g", "--out", str(fleet), "--no-progress"]) == 0
    # one engine, no shared tier, under a profile whose JSON carries network links of its own
    assert main(["replay", str(trace), "--tiers", "hbm=2", "--semantics", "prefix", *hardware,
                 str(_profile(tmp_path / "mybox.json", "mybox", 2e9)), "--out", str(one), "--no-progress"]) == 0
    assert read_results(one).hardware_profile.network is not None
    capsys.readouterr()
    assert main(["report", str(fleet), str(one), "-o", str(tmp_path / "r")]) == 0
    assert "shared tier over rdma-200g" in (tmp_path / "r" / "report.md").read_text()
    assert main(["report", str(one), str(fleet), "-o", str(tmp_path / "r2")]) == 0  # named by the fleet's network
    assert "shared tier over rdma-200g" in (tmp_path / "r2" / "report.md").read_text()
    # fleets over two networks still do not merge
    assert main(["replay", str(trace), "--instances", "2", "--tiers", "hbm=2,remote=4", *hardware, "h200-pcie5-nvme4",
                 "--network", "tcp-25g", "--out", str(other), "--no-progress"]) == 0
    capsys.readouterr()
    assert "modeled its shared tier over another network" in _error(capsys, "report", fleet, other, "-o", tmp_path / "r3")
