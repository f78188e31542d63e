"""Probe q27 F4: ``scripts/policy_zoo.py`` named a tied winner by registry order (lfu) where the
report names arc (ties go to LRU, then alphabetically), and the gap scripts replayed and printed
a capacity given twice twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_script_bench_honesty import _script
from tiercache.cli import main

pytest.importorskip("libcachesim")

HEAD = str(Path(__file__).parent / "data" / "mooncake_head.jsonl")


def test_zoo_names_the_reports_winner_of_a_tie_and_the_gap_scripts_replay_a_repeated_capacity_once(
        tmp_path, capsys) -> None:
    # At 100 blocks lfu, sieve and arc all miss 7,665 of 7,721.
    report = tmp_path / "r.json"
    assert main(["replay", HEAD, "--policy", "lru,fifo,lfu,arc,s3fifo,sieve,leaf_lru,session,cost,belady",
                 "--capacity", "100", "--out", str(report), "--workers", "1", "--no-progress"]) == 0
    assert main(["report", "--across", str(report), "-o", str(tmp_path / "g")]) == 0
    assert "| arc | 0.992747 | 12.4% |" in capsys.readouterr().out
    zoo = tmp_path / "zoo.json"
    assert _script("policy_zoo").main(["--trace", HEAD, "--capacity", "100,100", "--workers", "1", "--top", "4",
                                       "--json", str(zoo)]) == 0
    printed = capsys.readouterr().out
    assert "best of tiercache: arc 12.4%" in printed and printed.count("at 100 blocks") == 1
    rows = json.loads(zoo.read_text())["rows"]
    assert len(rows) == len({(r["side"], r["policy"]) for r in rows})  # 100 once
    assert [r["policy"] for r in rows if r["side"] == "tiercache"][:3] == ["arc", "lfu", "sieve"]
    assert _script("gap_closed").main(["--trace", HEAD, "--capacity", "100,400,400", "--policy", "arc",
                                       "--workers", "1"]) == 0
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("mooncake_head.jsonl") and len(line.split()) == 7] == ["100", "400"]
