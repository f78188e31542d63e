"""``scripts/bench_close.py`` times ``TieredKVCache.close()`` with a decode's scratch on NVMe (the
figures README gives) and refuses to report a close that left scratch behind."""

from __future__ import annotations

import json

import tiercache.live.store as live_store
from test_script_bench_honesty import _script


def test_bench_close_reports_both_ways_per_scratch_count(tmp_path, capsys):
    out = tmp_path / "close.json"
    assert _script("bench_close").main(["--scratch", "100", "--reps", "1", "--dir", str(tmp_path), "--json", str(out)]) == 0
    figures = json.loads(out.read_text(encoding="utf-8"))
    assert list(figures) == ["200"] and set(figures["200"]) == {"persist_false", "persist_true"}
    for row in figures["200"].values():
        assert row["close_ms"] > 0 and row["us_per_block"] == row["close_ms"] * 1e3 / 200
    assert "us/block" in capsys.readouterr().out


def test_bench_close_exits_1_when_close_leaves_the_scratch_on_nvme(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(live_store, "drop_scratch", lambda *args: 0)  # a close that deletes nothing
    assert _script("bench_close").main(["--scratch", "100", "--reps", "1", "--dir", str(tmp_path)]) == 1
    assert "left 168 blocks of a decode without ids on NVMe" in capsys.readouterr().err
