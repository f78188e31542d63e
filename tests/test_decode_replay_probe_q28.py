"""Probe q28, finding 2: a recorded decode replayed on tiers too small for the blocks its live
sequences hold at once is refused, as the live cache refuses the append (one line naming the
trace's file and line of the first write that does not fit and how many blocks are missing);
``compare`` leaves such runs out with that line on stderr and replays the others."""

from __future__ import annotations

import json

import torch

from tiercache import AttentionMode, TieredKVCache
from tiercache.cli import main
from tiercache.config import KVLayout, TierConfig


def _record(tmp_path):
    layout = KVLayout(1, 2, 8, "float32", 4)
    g = torch.Generator().manual_seed(0)
    kv = lambda t: (torch.randn(2, t, 8, generator=g), torch.randn(2, t, 8, generator=g))  # noqa: E731
    record = tmp_path / "steps.jsonl"
    tiers = [TierConfig("hbm", 8), TierConfig("dram", 8), TierConfig("nvme", 64)]
    with TieredKVCache(layout, tiers, path=tmp_path / "nvme", device="cpu", record=record) as cache:
        seq = cache.sequence()
        seq.append(0, *kv(120))  # 30 held blocks
        for _ in range(8):
            seq.append(0, *kv(1))
            seq.attend(0, torch.randn(4, 1, 8, generator=g), AttentionMode.SPARSE, 4)
    return record


def test_a_replay_on_tiers_that_cannot_hold_the_live_sequences_blocks_is_refused_naming_the_write(tmp_path, capsys):
    record = _record(tmp_path)
    first_write = 2  # the header is line 1
    code = main(["replay", str(record), "--tiers", "hbm=4,dram=4,nvme=8", "--no-progress", "--workers", "1"])
    captured = capsys.readouterr()
    assert code == 2 and "miss ratio" not in captured.out
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{record}:{first_write}:" in err and "30 new block(s) do not fit" in err and "14 more block(s)" in err, err
    assert "hbm=4,dram=4,nvme=8" in err

    out = tmp_path / "cmp"
    code = main(["compare", str(record), "--capacity", "20,64", "--policy", "lru,arc", "-o", str(out), "--no-progress",
                 "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 0
    refused = [line for line in err.splitlines() if "do not fit" in line]
    assert len(refused) == 1 and f"{record}:{first_write}:" in refused[0] and "capacity 20" in refused[0], err
    assert "10 more block(s)" in refused[0] and "2 runs" in refused[0]
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert sorted((r["policy"], r["capacity_blocks"]) for r in runs) == [("arc", 64), ("lru", 64)]

    code = main(["replay", str(record), "--tiers", "hbm=8,dram=8,nvme=64", "--no-progress", "--workers", "1",
                 "--out", str(tmp_path / "r.json")])
    assert code == 0  # the tiers it was recorded on hold it: nothing refused
    run = json.loads((tmp_path / "r.json").read_text())["runs"][0]
    assert all(t["refused"] == 0 for t in run["tiers"])
