"""Probe Q52 (hardware profiles): names that could pass for a preset, ``--network`` over a
profile's own network links, and a measured profile a replay could not load.

- A profile named ``"h200-pcie5-nvme4 "`` (a trailing space), with a Unicode hyphen, a
  zero-width space or another case was accepted with made-up numbers, and reports showed it
  as the preset; a network preset's name alone passed as a machine.
- A profile giving ``remote->dram``/``dram->remote`` run with ``--network`` had its links
  replaced silently.
- ``bench --save-profile`` wrote links outside the loader's ranges (a disk writing below
  1 MB/s), which every replay then refused.
- The report called every profile a "hardware preset" (it now says "hardware").
"""

from __future__ import annotations

import argparse
import json

import pytest

from tiercache.bench.tiers import save_measured_profile
from tiercache.cli.fleet import _network
from tiercache.errors import UserError
from tiercache.sim.hardware import PRESETS, load_profile

PRESET = "h200-pcie5-nvme4"


def _profile(tmp_path, name: str, network: bool = False) -> str:
    links = {n: {"bandwidth_Bps": l.bandwidth_Bps, "latency_s": l.latency_s} for n, l in PRESETS[PRESET].links.items()}
    links["dram->nvme"]["bandwidth_Bps"] = 1e9  # not the preset's numbers
    if network:
        links["remote->dram"] = links["dram->remote"] = {"bandwidth_Bps": 3e9, "latency_s": 5e-5}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"name": name, "links": links, "prefill_tokens_per_s": 1000}), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("name, says", [
    (PRESET + " ", "whitespace"), (" " + PRESET, "whitespace"), ("h200\u2010pcie5-nvme4", "printable ASCII"),
    ("h200-pcie5\u200b-nvme4", "printable ASCII"), ("H200-PCIE5-NVME4", "like preset"), ("mybox+TCP-25g", "like preset"),
    ("tcp-25g", "network preset"), ("box\x07", "printable ASCII"),
    # review R31: a minus sign, a full-width plus, underscores or spaces for dashes, O for 0, Cyrillic, none
    ("h200\u2212pcie5-nvme4", "printable ASCII"), (PRESET + "\uff0btcp-25g", "printable ASCII"),
    ("h200_pcie5_nvme4", "like preset"), ("h200 pcie5 nvme4", "like preset"), ("h2OO-pcie5-nvme4", "like preset"),
    ("\u04bb200-pcie5-nvme4", "printable ASCII"), ("None", "no hardware"),
])
def test_a_name_that_could_pass_for_a_preset_is_refused(tmp_path, name, says):
    with pytest.raises(UserError, match=says) as refused:
        load_profile(_profile(tmp_path, name))
    assert "profile.json" in str(refused.value)


def test_a_name_of_its_own_loads(tmp_path):
    assert load_profile(_profile(tmp_path, "my box (lab 2)")).name == "my box (lab 2)"


def test_network_over_a_profiles_own_network_links_is_refused(tmp_path):
    hardware = load_profile(_profile(tmp_path, "mybox", network=True))
    assert _network(argparse.Namespace(network=None), hardware) is hardware
    with pytest.raises(UserError, match="--network rdma-200g: hardware profile .*profile.json gives"):
        _network(argparse.Namespace(network="rdma-200g"), hardware)


def test_a_measured_profile_a_replay_could_not_load_is_not_written(tmp_path):
    result = {"cold_reads_refused": None,
              "tiercache": {"host_to_device": 1.8, "device_to_host": 2.6, "disk_read_cold": 0.048, "disk_write": 0.0009},
              "latency_s": {"host_to_device": 1e-6, "device_to_host": 1e-6, "disk_read_cold": 6e-5, "disk_write": 0.012}}
    with pytest.raises(ValueError, match="dram->nvme"):
        save_measured_profile(result, str(tmp_path / "slow.json"))
    assert not (tmp_path / "slow.json").exists()
    result["tiercache"]["disk_write"] = 0.5
    save_measured_profile(result, str(tmp_path / "ok.json"))
    assert load_profile(str(tmp_path / "ok.json")).links["dram->nvme"].bandwidth_Bps == 5e8


def test_a_host_name_that_would_make_a_bad_profile_name_is_made_safe(tmp_path, monkeypatch):
    """Review R31: ``measured-<hostname>`` was written as it came; a host named
    ``node+rdma-200g`` or with a zero-width space gave a profile every replay refused."""
    result = {"cold_reads_refused": None,
              "tiercache": {"host_to_device": 1.8, "device_to_host": 2.6, "disk_read_cold": 0.048, "disk_write": 0.5},
              "latency_s": {"host_to_device": 1e-6, "device_to_host": 1e-6, "disk_read_cold": 6e-5, "disk_write": 0.012}}
    made = {"node+rdma-200g": "measured-node-rdma-200g", "gpu-box\u200b": "measured-gpu-box-",
            "node+TCP-25G": "measured-node-TCP-25G"}
    for host, name in made.items():
        monkeypatch.setattr("socket.gethostname", lambda host=host: host)
        save_measured_profile(result, str(tmp_path / "m.json"))
        assert json.loads((tmp_path / "m.json").read_text())["name"] == name  # the name as written
        assert load_profile(str(tmp_path / "m.json")).name == name
