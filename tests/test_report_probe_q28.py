"""Probe q28, finding 3: in a recorded live decode no held block leaves the tiers, so every
policy misses 0%; the report must not name a winner by that miss ratio (it says the miss ratio
cannot tell the policies apart and compares what differs: reads served from HBM here), and it
must not advise adding belady to a trace that refuses it (a recorded run gives no future)."""

from __future__ import annotations

import json

import torch

from tiercache import AttentionMode, TieredKVCache
from tiercache.cli import main
from tiercache.config import KVLayout, TierConfig


def _record_two_sequences(path) -> None:
    layout = KVLayout(2, 2, 8, "float32", 4)
    g = torch.Generator().manual_seed(0)
    kv = lambda t: (torch.randn(2, t, 8, generator=g), torch.randn(2, t, 8, generator=g))  # noqa: E731
    tiers = [TierConfig("hbm", 5), TierConfig("dram", 6), TierConfig("nvme", 60)]
    with TieredKVCache(layout, tiers, path=path.parent / "nvme", device="cpu", prefetch="none", record=path) as cache:
        a, b = cache.sequence(), cache.sequence(tokens=list(range(30)), namespace="x")
        for layer in range(2):
            a.append(layer, *kv(37))
            b.append(layer, *kv(30))
        for step in range(12):
            for layer in range(2):
                for seq in (a, b):
                    seq.append(layer, *kv(1))
                    sparse = step % 3 != 0
                    seq.attend(layer, torch.randn(4, 1, 8, generator=g) * 1.5,
                               AttentionMode.SPARSE if sparse else AttentionMode.EXACT, 3 if sparse else None)


def _findings(report: str) -> str:
    return report.split("Key findings:", 1)[1].split("The trace and the presets", 1)[0]


def test_a_decode_report_names_no_winner_by_a_miss_ratio_every_policy_shares_nor_advises_a_refused_belady(tmp_path):
    trace = tmp_path / "two.jsonl"
    _record_two_sequences(trace)
    out = tmp_path / "cmp"
    assert main(["compare", str(trace), "--tiers", "hbm=5,dram=6,nvme=60", "--policy", "lru,arc", "-o", str(out),
                 "--no-progress", "--workers", "1"]) == 0
    runs = {r["policy"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert {r["misses"] for r in runs.values()} == {0}
    hbm = {policy: run["tiers"][0]["hits"] for policy, run in runs.items()}
    assert hbm["lru"] != hbm["arc"]  # where the reads are served does differ
    leader, other = sorted(hbm, key=hbm.get, reverse=True)
    report = (out / "report.md").read_text()
    findings = _findings(report)
    assert "no other online policy beats" not in findings
    assert "cannot tell them apart" in findings
    assert f"{leader} serves the most reads from HBM ({hbm[leader]:,}; {other} {hbm[other]:,})" in findings
    assert "add belady to --policy" not in report
    assert "belady needs the future" in report
