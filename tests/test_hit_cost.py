"""Every lower-tier hit of a tiered replay is charged: read in place or promoted, never free (issue 8 item 13)."""

from __future__ import annotations

import json

import pytest

from tiercache.cli import main

LAYOUT = "layers=32,kv_heads=8,head_dim=128,dtype=bfloat16"
BLOCK_BYTES = 2 * 32 * 8 * 128 * 2 * 512


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    assert main(["trace", "synth", "docs", "-o", str(path), "--docs", "100", "--blocks", "32", "--requests", "400",
                 "--zipf", "1.0", "--seed", "0"]) == 0
    return path


def _run(path, hbm: int) -> dict:
    out = path.parent / f"hbm{hbm}.json"
    assert main(["replay", str(path), "--tiers", f"hbm={hbm},dram=64,nvme=4096", "--layout", LAYOUT,
                 "--hardware", "h200-pcie5-nvme4", "--semantics", "prefix", "--no-progress", "--workers", "1",
                 "--out", str(out)]) == 0
    return json.loads(out.read_text())["runs"][0]


def test_hits_too_large_to_promote_are_read_in_place_and_charged(docs, capsys):
    run = _run(docs, 16)  # every request's run of blocks (2 + 32) is larger than HBM: promotion is skipped
    hbm, dram, nvme = run["tiers"]
    assert nvme["hits_in_place"] > 0.9 * nvme["hits"] and nvme["hits_in_place"] + nvme["hits_promoted"] == nvme["hits"]
    assert nvme["in_place_bytes"] == nvme["hits_in_place"] * BLOCK_BYTES and nvme["in_place_seconds"] > 0
    assert hbm["hits_in_place"] == hbm["hits"] and hbm["in_place_bytes"] == 0
    moved = run["bytes_moved"]["nvme->hbm"]
    assert moved >= nvme["hits"] * BLOCK_BYTES  # every NVMe hit crossed the link, promoted or not


def test_a_smaller_hbm_never_looks_better(docs, capsys):
    small, large = _run(docs, 16), _run(docs, 64)
    assert small["ttft_saved_s"] <= large["ttft_saved_s"]
    for run in (small, large):
        for tier in run["tiers"][1:]:
            charged = tier["in_place_seconds"] + tier["promoted_seconds"]
            assert tier["hits"] == 0 or charged > 0
