"""Per-tier codecs in the replay's cost model and in compare/report (issue 10 part 4):
a quantised tier holds the codec's real bytes per block, transfers touching it move those
bytes, and a report says how many more blocks the tier holds than unquantised KV."""

from __future__ import annotations

import json

import pytest

from tiercache.cli import main
from tiercache.config import Codec, ConfigError, TierConfig, layout_preset, parse_tiers
from tiercache.results import SCHEMA_VERSION
from tiercache.sim.engine import SimEngine
from tiercache.sim.hardware import PRESETS

TRACE = "tests/data/mooncake_head.jsonl"
LAYOUT = layout_preset("llama-3-8b", block_tokens=512)


def test_tiers_take_a_codec_and_sizes_count_quantised_blocks():
    plain = parse_tiers("hbm=100,dram=8GiB,nvme=64GiB", LAYOUT)
    quant = parse_tiers("hbm=100,dram=8GiB:int8,nvme=64GiB:int4", LAYOUT)
    assert [t.codec for t in quant] == [Codec.NONE, Codec.INT8, Codec.INT4]
    assert quant[1].capacity_blocks == 8 * 2**30 // Codec.INT8.block_bytes(LAYOUT)
    assert quant[2].capacity_blocks == 64 * 2**30 // Codec.INT4.block_bytes(LAYOUT)
    assert quant[2].capacity_blocks >= 3.6 * plain[2].capacity_blocks
    with pytest.raises(ConfigError, match="--tiers nvme: unknown codec 'int3'"):
        parse_tiers("hbm=100,nvme=1000:int3", LAYOUT)


def test_a_transfer_moves_the_form_the_data_plane_moves():
    tiers = (TierConfig("hbm", 4), TierConfig("dram", 8, codec=Codec.INT8), TierConfig("nvme", 16, codec=Codec.INT4))
    sizes = tuple(t.codec.block_bytes(LAYOUT) for t in tiers)
    h200 = PRESETS["h200-pcie5-nvme4"]
    engine = SimEngine(("hbm", "dram", "nvme"), LAYOUT.block_bytes, h200, tier_block_bytes=sizes)
    assert engine.cost(0, 1, 3)[0] == 3 * sizes[1]  # demoted: encoded, then copied
    assert engine.cost(1, 0, 3)[0] == 3 * sizes[1]  # promoted: copied encoded, then decoded
    assert engine.cost(1, 2, 1)[0] == sizes[2]
    # NVMe -> plain HBM is staged through the host, where the store decodes: INT4 off the
    # disk, then a plain block over PCIe (the bytes that arrive in HBM).
    nbytes, seconds = engine.cost(2, 0, 2)
    assert nbytes == 2 * LAYOUT.block_bytes
    assert seconds == pytest.approx(h200.seconds("nvme->dram", 2 * sizes[2]) + h200.seconds("dram->hbm", 2 * LAYOUT.block_bytes))
    plain = SimEngine(("hbm", "dram", "nvme"), LAYOUT.block_bytes, PRESETS["h200-pcie5-nvme4"])
    assert engine.cost(2, 1, 1)[1] < plain.cost(2, 1, 1)[1] / 3.5  # NVMe reads of INT4 blocks: ~3.6x less time


def test_compare_reports_what_the_quantised_tier_holds(tmp_path):
    out = tmp_path / "report"
    argv = ["compare", TRACE, "--policy", "lru", "--tiers", "hbm=200,dram=400,nvme=4GiB:int4", "--model", "llama-3-8b",
            "--hardware", "h200-pcie5-nvme4", "-o", str(out)]
    assert main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    nvme = doc["runs"][0]["tiers"][2]
    assert doc["schema_version"] == SCHEMA_VERSION and nvme["codec"] == "int4"
    assert nvme["block_bytes"] == Codec.INT4.block_bytes(LAYOUT)
    assert nvme["capacity_blocks"] == 4 * 2**30 // Codec.INT4.block_bytes(LAYOUT)
    assert doc["runs"][0]["tiers"][0]["codec"] == "none" and doc["runs"][0]["tiers"][0]["block_bytes"] == LAYOUT.block_bytes
    moved = doc["runs"][0]["bytes_moved"]
    assert moved.get("dram->nvme", 0) % Codec.INT4.block_bytes(LAYOUT) == 0
    ratio = LAYOUT.block_bytes / Codec.INT4.block_bytes(LAYOUT)
    text = (out / "report.md").read_text()
    assert "NVMe with INT4 stores a block in" in text and f"{ratio:.1f}× the blocks of unquantised KV" in text
    assert f"HBM 200 + DRAM 400 + NVMe {nvme['capacity_blocks']:,} INT4" in text
    assert ",int4," in (out / "results.csv").read_text()
