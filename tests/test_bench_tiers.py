"""``tiercache bench`` / ``scripts/bench_tiers.py``: shape of the results, not speed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiercache.cli import main
from tiercache.errors import UserError
from tiercache.sim.hardware import load_profile

ROOT = Path(__file__).resolve().parent.parent
RATIOS = {"host_to_device", "device_to_host", "disk_write", "disk_read_cold"}


def positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick benchmark run shared by the checks below."""
    tmp = tmp_path_factory.mktemp("bench")
    rc = main(["bench", "--quick", "--dir", str(tmp), "--json", str(tmp / "bench.json"), "--save-profile", str(tmp / "profile.json")])
    return rc, tmp


def test_quick_bench_writes_ratios_raw_and_tiercache_figures(quick_run, capsys):
    rc, tmp = quick_run
    assert rc == 0
    result = json.loads((tmp / "bench.json").read_text())
    assert set(result["ratios"]) == {"host_to_device", "disk_write", "disk_read_cold"}
    assert set(result["raw"]) == RATIOS and set(result["tiercache"]) == RATIOS
    for section in ("ratios", "other_ratios", "raw", "tiercache"):
        assert all(positive(v) for v in result[section].values()), result[section]
    for side in ("raw", "tiercache"):
        assert all(len(v) == 2 and all(positive(x) for x in v) for v in result["samples"][side].values())
    assert positive(result["zarr_api"]["write"]) and positive(result["zarr_api"]["read_cold"])
    assert positive(result["first_fill_write"]["ratio"]) and positive(result["disk_read_cold_one_big_file"]["raw"])
    assert all(v >= 0 for v in result["latency_s"].values())


def test_quick_bench_describes_the_machine_and_baselines(quick_run):
    _, tmp = quick_run
    result = json.loads((tmp / "bench.json").read_text())
    machine = result["machine"]
    for key in ("hostname", "cpus", "memory_bytes", "torch", "device", "filesystem", "store_direct_io", "sync_policy"):
        assert key in machine, key
    assert set(machine["baselines"]) == RATIOS
    assert "fdatasync" in machine["sync_policy"]
    assert result["config"]["blocks"] == 16 and result["config"]["reps"] == 2
    assert not [p for p in os.listdir(tmp) if p.startswith(".tiercache-bench-")], "the work folder is removed"


def test_saved_profile_loads_as_a_hardware_profile(quick_run):
    _, tmp = quick_run
    profile = load_profile(str(tmp / "profile.json"))
    assert profile.name.startswith("measured-")
    assert set(profile.links) == {"dram->hbm", "hbm->dram", "nvme->dram", "dram->nvme"}
    assert all(link.bandwidth_Bps > 0 and link.latency_s >= 0 for link in profile.links.values())
    assert profile.prefill_tokens_per_s is None  # measured links only; prefill is never invented
    with pytest.raises(UserError, match="no prefill speed"):
        profile.require_prefill()


def test_replay_refuses_ttft_with_a_profile_without_prefill(quick_run, capsys):
    _, tmp = quick_run
    trace = Path(__file__).parent / "data" / "mooncake_head.jsonl"
    code = main(["replay", str(trace), "--model", "llama-3-8b", "--hardware", str(tmp / "profile.json"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "no prefill speed" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, message", [(["--blocks", "0"], "--blocks must be a positive integer"),
                                           (["--dir", "/nonexistent/x"], "not a directory"),
                                           (["--model", "gpt-17"], "unknown model preset")])
def test_bad_options_are_one_line_errors(tmp_path, capsys, argv, message):
    assert main(["bench", "--json", str(tmp_path / "b.json"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_script_runs_the_same_command(tmp_path):
    out = tmp_path / "script.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_tiers.py"), "--quick", "--no-zarr-api", "--dir", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "NVMe cold block reads" in done.stdout
    result = json.loads(out.read_text())
    assert set(result["ratios"]) == {"host_to_device", "disk_write", "disk_read_cold"} and result["zarr_api"] is None
