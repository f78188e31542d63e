"""``tiercache replay --instances N`` prints a summary above ``LISTED_INSTANCES`` instances, as the
report does (review Q22: 200k instances printed 200k rows and a 200k-figure TTFT line)."""

from __future__ import annotations

from pathlib import Path

from tiercache.cli import main
from tiercache.report.fleet import EXTREMES, LISTED_INSTANCES

HEAD = Path(__file__).parent / "data" / "mooncake_head.jsonl"


def _fleet(instances: int, capsys) -> list[str]:
    assert main(["replay", str(HEAD), "--instances", str(instances), "--tiers", "hbm=20,remote=200",
                 "--model", "llama-3-8b", "--hardware", "h200-pcie5-nvme4", "--no-progress"]) == 0
    return capsys.readouterr().out.splitlines()


def test_a_fleet_of_more_instances_than_listed_prints_min_median_max_extremes_and_all(capsys):
    lines = _fleet(LISTED_INSTANCES + 8, capsys)
    firsts = [line.split()[0] for line in lines if line.strip() and "instances, more than" not in line]
    assert any(f"{LISTED_INSTANCES + 8} instances, more than the {LISTED_INSTANCES}" in line for line in lines)
    for name in ("min", "median", "max", "all"):
        assert firsts.count(name) == 1
    numbered = [f for f in firsts if f.isdigit()]
    assert len(numbered) == 2 * EXTREMES
    assert not any(line.startswith("modeled TTFT saved (") and "per instance" in line for line in lines)


def test_a_small_fleet_still_lists_every_instance(capsys):
    lines = _fleet(3, capsys)
    firsts = [line.split()[0] for line in lines if line.strip()]
    assert [f for f in firsts if f.isdigit()] == ["0", "1", "2"]
    assert any("per instance" in line for line in lines)
