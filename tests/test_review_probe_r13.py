"""Probe r13: defects found in the review of d3f3afa..bd642ee."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from conftest import SAMPLE_TRACE
from tiercache.cli import main
from tiercache.config import MODEL_PRESETS
from tiercache.errors import UserError
from tiercache.results import read_results
from tiercache.sim import replay as replay_module
from tiercache.sim.hardware import PRESETS, HardwareProfile, Link, load_profile, save_profile, with_network
from tiercache.sim.loader import load_trace
from tiercache.sim.prefill import mean_read_index
from tiercache.sim.replay import ReplayData

ROOT = Path(__file__).resolve().parent.parent

_ABANDONING_TEST = '''
import warnings
from tiercache.data.remote_guard import abandon_client

def test_abandons_a_client():
    abandon_client(object(), ())  # as RemoteStore.close does with a client of a hung master
    warnings.warn("a late warning", UserWarning)
    assert {ok}
'''


def _pytest_rc(folder: Path, ok: bool, *args: str) -> int:
    folder.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", folder / "conftest.py")
    (folder / "test_abandon.py").write_text(_ABANDONING_TEST.format(ok=ok))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(folder), *args, "test_abandon.py"]
    return subprocess.run(argv, cwd=folder, env=env, capture_output=True, timeout=300).returncode


def test_the_process_exits_with_pytests_final_status_after_a_client_was_abandoned(tmp_path):
    assert _pytest_rc(tmp_path / "warned", True, "--max-warnings", "0") == 6  # set after sessionfinish's argument
    assert _pytest_rc(tmp_path / "failed", False) == 1
    assert _pytest_rc(tmp_path / "passed", True) == 0


def _mean_read_index_per_access(offsets, is_write) -> float:
    """The formula of bd642ee: every access's index within its batch, then the reads' mean."""
    index = np.arange(int(offsets[0]), int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], np.diff(offsets))
    if is_write is not None:
        index = index[~is_write]
    return float(index.mean()) if len(index) else 0.0


def test_the_mean_read_index_is_the_per_access_mean_computed_per_batch_once_per_trace(monkeypatch):
    rng = np.random.default_rng(13)
    counts = rng.integers(0, 40, size=20_000)
    counts[-3:] = 0  # empty batches, at the end too
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    reads = np.concatenate([np.arange(c) < rng.integers(0, c + 1) for c in counts])  # reads before writes
    for is_write in (None, ~reads, np.zeros(len(reads), bool), np.ones(len(reads), bool)):
        assert mean_read_index(offsets, is_write) == _mean_read_index_per_access(offsets, is_write)
    assert mean_read_index(offsets + 7, ~reads) == _mean_read_index_per_access(offsets + 7, ~reads)
    assert mean_read_index(np.zeros(1, np.int64), None) == 0.0
    trace = load_trace(str(SAMPLE_TRACE))
    data = ReplayData.prepare(trace, MODEL_PRESETS["llama-3-8b"], PRESETS["h200-pcie5-nvme4"])
    calls = []
    monkeypatch.setattr(replay_module, "mean_read_index", lambda *a: calls.append(a) or 1.5)
    assert data.mean_read_index == data.mean_read_index == 1.5 and len(calls) == 1


def test_a_profile_json_named_like_a_preset_machine_plus_a_network_needs_their_numbers(tmp_path):
    machine = PRESETS["h200-pcie5-nvme4"]
    combined = with_network(machine, "rdma-200g")
    save_profile(combined, tmp_path / "same.json")
    assert load_profile(str(tmp_path / "same.json")) == combined  # what --network builds, saved: accepted
    slow_net = HardwareProfile(combined.name, {**combined.links, "remote->dram": Link(1e9, 1e-5), "dram->remote": Link(1e9, 1e-5)},
                               combined.prefill_tokens_per_s)
    slow_pcie = HardwareProfile(combined.name, {**combined.links, "dram->hbm": Link(1e9, 1e-5)}, combined.prefill_tokens_per_s)
    other_rate = HardwareProfile(combined.name, combined.links, 5000)
    own_box = HardwareProfile("mybox+tcp-25g", slow_net.links, 5000)  # network preset named, its links not that preset's
    for profile, named in ((slow_net, "network preset 'rdma-200g'"), (slow_pcie, "machine preset 'h200-pcie5-nvme4'"),
                           (other_rate, "machine preset 'h200-pcie5-nvme4'"), (own_box, "network preset 'tcp-25g'")):
        save_profile(profile, tmp_path / "p.json")
        with pytest.raises(UserError, match="give the profile a name of its own") as error:
            load_profile(str(tmp_path / "p.json"))
        assert named in str(error.value) and "\n" not in str(error.value)
    save_profile(HardwareProfile("mybox+rdma-200g", combined.links, 5000), tmp_path / "own.json")
    assert load_profile(str(tmp_path / "own.json")).name == "mybox+rdma-200g"  # its own machine over rdma-200g's links


HEAD = ROOT / "tests" / "data" / "mooncake_head.jsonl"
FLAT = "layers=32,kv_heads=8,head_dim=128"


def _replay(out: Path, *model: str) -> dict:
    argv = ["replay", str(HEAD), "--policy", "lru", "--tiers", "hbm=50,dram=200", "--semantics", "prefix", *model,
            "--hardware", "h200-pcie5-nvme4", "--workers", "1", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    return json.loads(out.read_text())["hardware_profile"]


def test_a_report_refuses_runs_whose_prefill_used_another_models_params_or_heads(tmp_path, capsys):
    assert _replay(tmp_path / "flat.json", "--layout", FLAT)["prefill"] == {"params": None, "heads": None}
    assert _replay(tmp_path / "big.json", "--layout", FLAT + ",params=70.55e9,heads=64")["prefill"] == {"params": 70_550_000_000, "heads": 64}
    assert _replay(tmp_path / "preset.json", "--model", "llama-3-70b")["prefill"] == {"params": 70_553_706_496, "heads": 64}
    assert read_results(tmp_path / "big.json").hardware_profile.prefill.heads == 64
    capsys.readouterr()
    assert main(["report", str(tmp_path / "flat.json"), str(tmp_path / "big.json"), "-o", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "another model (params 7.055e+10, 64 query heads)" in err
    assert "(reference params (none given), no query heads" in err


def _methods(folder: Path) -> str:
    text = (folder / "report.md").read_text()
    return text[text.index("misses recomputed"):].split(". Model preset")[0]


def _as_flat_rate_file(path: Path) -> Path:
    """``path`` as tiercache wrote it under the flat per-token rate: no prefill_model nor prefill."""
    document = json.loads(path.read_text())
    profile = document["hardware_profile"]
    del profile["prefill_model"], profile["prefill"]
    body = json.dumps({"links": profile["links"], "prefill_tokens_per_s": profile["prefill_tokens_per_s"]},
                      sort_keys=True, separators=(",", ":"))
    profile["digest"] = "xxh3-64:" + xxhash.xxh3_64_hexdigest(body.encode())
    legacy = path.with_name("legacy.json")
    legacy.write_text(json.dumps(document))
    return legacy


def test_the_reports_methods_text_names_only_the_prefill_terms_its_runs_were_modeled_with(tmp_path, capsys):
    argv = ["compare", str(HEAD), "--policy", "lru,arc", "--capacity", "250", "--semantics", "prefix", "--layout", FLAT,
            "--hardware", "h200-pcie5-nvme4", "--workers", "1", "--no-progress", "-o", str(tmp_path / "cmp")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "note: --layout gives no params=" in out and "note: --layout gives no heads=" in out  # as replay prints them
    flat = _methods(tmp_path / "cmp")
    assert "no attention term" in flat and "reference model's (llama-3-8b) parameters" in flat and "plus attention" not in flat
    _replay(tmp_path / "big.json", "--layout", FLAT + ",params=70.55e9,heads=64")
    assert main(["report", str(tmp_path / "big.json"), "-o", str(tmp_path / "big")]) == 0
    big = _methods(tmp_path / "big")
    assert "plus attention over each token's prefix" in big and "(64)" in big and "7.055e+10 parameters" in big
    assert main(["report", str(_as_flat_rate_file(tmp_path / "big.json")), "-o", str(tmp_path / "old")]) == 0
    old = _methods(tmp_path / "old")
    assert "flat per-token prefill rate" in old and "FLOPs" not in old
