"""scripts/bench_put_policies.py: runs, checks what it put, refuses what it cannot compare."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "bench_put_policies.py"


def test_the_put_benchmark_reports_every_policy_against_lru(tmp_path):
    out = tmp_path / "put.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--policy", "lru,arc", "--slots", "200", "--batch", "50",
                           "--reps", "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())["policies"]
    assert set(figures) == {"lru", "arc"} and figures["lru"]["ratio_to_lru"] == 1.0
    assert figures["arc"]["ms_per_put"] > 0 and figures["arc"]["batch_insert_safe"] is False
    assert "one at a time" in done.stdout and "the batch at once" in done.stdout


def test_the_put_benchmark_refuses_an_offline_policy_or_no_lru_first():
    for policy in ("lru,belady", "arc,lru", "lru,nope"):
        done = subprocess.run([sys.executable, str(SCRIPT), "--policy", policy], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2 and "--policy: online registered policies, lru first" in done.stderr
