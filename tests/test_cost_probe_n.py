"""Cost model and profile findings of probe N (fix Na: findings 1, 2/4, 3/5, 5/6, 6/7).

Each test builds its inputs in ``tmp_path`` and fails on the code before its fix.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tiercache.config import Codec, TierConfig, layout_preset, parse_layout
from tiercache.errors import ConfigError, UserError
from tiercache.results import Semantics
from tiercache.sim import replay as replay_module
from tiercache.sim.engine import SimEngine
from tiercache.sim.hardware import PRESETS, REQUIRED_LINKS, load_profile, save_profile
from tiercache.sim.loader import load_trace
from tiercache.sim.replay import ReplayData, RunSpec, replay
from tiercache.sim.traces import Request, write_requests
from test_cli_errors import _error  # runs the CLI, asserts exit 2 with one line

LAYOUT = layout_preset("llama-3-8b", block_tokens=512)
PLAIN = LAYOUT.block_bytes
INT4 = Codec.INT4.block_bytes(LAYOUT)
INT8 = Codec.INT8.block_bytes(LAYOUT)
H200 = PRESETS["h200-pcie5-nvme4"]
NAMES = ("hbm", "dram", "nvme")


def _engine(*codecs: Codec) -> SimEngine:
    return SimEngine(NAMES, PLAIN, H200, tier_block_bytes=tuple(c.block_bytes(LAYOUT) for c in codecs))


# ----------------------------------------------------------------------------- finding 1


def test_int4_dram_to_plain_nvme_moves_whole_blocks_both_ways():
    """The host decodes an INT4 block before writing it to a plain NVMe tier, and reads a
    plain block whole before encoding it: the drive moves the full block both ways."""
    engine = _engine(Codec.NONE, Codec.INT4, Codec.NONE)
    for src, dst, link in ((1, 2, "dram->nvme"), (2, 1, "nvme->dram")):
        nbytes, seconds = engine.cost(src, dst, 3)
        assert nbytes == 3 * PLAIN
        assert seconds == pytest.approx(H200.seconds(link, 3 * PLAIN))
    assert engine.cost(0, 1, 3)[0] == engine.cost(1, 0, 3)[0] == 3 * INT4  # the GPU encodes and decodes


def test_a_storage_tier_moves_its_own_form_and_a_quantised_memory_destination_its():
    """INT4 DRAM over INT8 NVMe: the drive writes and reads INT8. INT4 DRAM under INT8 HBM:
    the host re-encodes to INT8 before the copy up; the other way the GPU encodes INT4."""
    engine = _engine(Codec.INT8, Codec.INT4, Codec.INT8)
    assert engine.cost(1, 2, 1)[0] == engine.cost(2, 1, 1)[0] == INT8
    assert engine.cost(1, 0, 1)[0] == INT8 and engine.cost(0, 1, 1)[0] == INT4


def test_staged_hbm_nvme_moves_charge_each_hop_at_its_own_bytes():
    """Plain HBM <-> INT4 NVMe is staged through the host, where the store encodes or
    decodes: INT4 on the drive's hop, the plain block on the PCIe hop."""
    engine = _engine(Codec.NONE, Codec.NONE, Codec.INT4)
    nbytes, seconds = engine.cost(0, 2, 2)
    assert nbytes == 2 * INT4  # what arrives in NVMe
    assert seconds == pytest.approx(H200.seconds("hbm->dram", 2 * PLAIN) + H200.seconds("dram->nvme", 2 * INT4))
    nbytes, seconds = engine.cost(2, 0, 2)
    assert nbytes == 2 * PLAIN  # what arrives in HBM
    assert seconds == pytest.approx(H200.seconds("nvme->dram", 2 * INT4) + H200.seconds("dram->hbm", 2 * PLAIN))


def _mixed_trace(tmp_path: Path) -> str:
    """Fresh blocks that push earlier ones down to NVMe, then requests that read them back."""
    requests = [Request(r, 512 * 3, 1, (3 * r, 3 * r + 1, 3 * r + 2)) for r in range(40)]
    requests += [Request(40 + r, 512 * 3, 1, (3 * r, 3 * r + 1, 3 * r + 2)) for r in range(0, 40, 3)]
    path = str(tmp_path / "mixed.jsonl")
    write_requests(path, requests)
    return path


def test_replay_charges_demotions_into_a_plain_nvme_under_int4_dram_whole(tmp_path, monkeypatch):
    """Compiled and Python replays agree, and every DRAM -> NVMe demotion is a full block."""
    tiers = (TierConfig("hbm", 4), TierConfig("dram", 8, codec=Codec.INT4), TierConfig("nvme", 200))
    spec = RunSpec("lru", Semantics.OBJECT, tiers)
    data = ReplayData.prepare(load_trace(_mixed_trace(tmp_path)), LAYOUT, H200)
    assert replay_module.use_kernels(spec)
    ours = replay(spec, data)
    with monkeypatch.context() as patched:
        patched.setattr(replay_module, "use_kernels", lambda spec: False)
        reference = replay(spec, data)
    assert dataclasses.replace(ours, wall_seconds=0) == dataclasses.replace(reference, wall_seconds=0)
    dram, nvme = ours.tiers[1], ours.tiers[2]
    assert dram.demotions > 0 and nvme.hits > 0
    assert ours.bytes_moved["dram->nvme"] == dram.demotions * PLAIN
    assert ours.modeled_seconds["dram->nvme"] >= dram.demotions * PLAIN / H200.links["dram->nvme"].bandwidth_Bps


# ----------------------------------------------------------------------------- findings 2 and 3 (brief 4 and 5)


def _profile_file(tmp_path: Path, mutate) -> Path:
    data = {"name": "box", "links": {n: {"bandwidth_Bps": 5e9, "latency_s": 1e-5} for n in REQUIRED_LINKS},
            "prefill_tokens_per_s": 28000}
    mutate(data)
    path = tmp_path / "box.json"
    path.write_text(json.dumps(data))
    return path


def _set_link(name: str, field: str, value):
    return lambda data: data["links"][name].__setitem__(field, value)


@pytest.mark.parametrize("mutate,field", [
    (_set_link("dram->hbm", "bandwidth_Bps", 10**400), "links['dram->hbm'].bandwidth_Bps"),
    (_set_link("nvme->dram", "latency_s", 10**400), "links['nvme->dram'].latency_s"),
    (lambda data: data.__setitem__("prefill_tokens_per_s", 10**400), "prefill_tokens_per_s"),
])
def test_a_huge_integer_in_a_profile_is_a_one_line_error(tmp_path, capsys, mutate, field):
    path = _profile_file(tmp_path, mutate)
    err = _error(capsys, "replay", _mixed_trace(tmp_path), "--model", "llama-3-8b", "--hardware", path, "--no-progress")
    assert str(path) in err and field in err and "401 digits" in err


@pytest.mark.parametrize("mutate,field,accepted", [
    (_set_link("dram->hbm", "latency_s", 1e308), "links['dram->hbm'].latency_s", "from 0 to 10 s"),
    (_set_link("hbm->dram", "bandwidth_Bps", 1e-300), "links['hbm->dram'].bandwidth_Bps", "from 1e+06 to 1e+15 B/s"),
    (lambda data: data.__setitem__("prefill_tokens_per_s", 1e-300), "prefill_tokens_per_s", "from 1 to 1e+09 tokens/s"),
])
def test_an_absurd_finite_profile_value_is_refused_with_the_range(tmp_path, mutate, field, accepted):
    path = _profile_file(tmp_path, mutate)
    with pytest.raises(UserError) as info:
        load_profile(str(path))
    assert str(path) in str(info.value) and field in str(info.value) and accepted in str(info.value)


def test_every_preset_round_trips_within_the_accepted_ranges(tmp_path):
    for name, profile in PRESETS.items():
        save_profile(profile, tmp_path / f"{name}.json")
        assert load_profile(str(tmp_path / f"{name}.json")) == profile


# ----------------------------------------------------------------------------- finding 5 (brief 6)


def test_layout_block_tokens_other_than_the_traces_is_refused(tmp_path, capsys):
    err = _error(capsys, "replay", _mixed_trace(tmp_path), "--capacity", "256MiB", "--no-progress",
                 "--layout", "layers=32,kv_heads=8,head_dim=128,block_tokens=16")
    assert "--layout" in err and "block_tokens=16" in err and "512 tokens" in err
    assert parse_layout("layers=32,kv_heads=8,head_dim=128,block_tokens=512", 512).block_tokens == 512
    with pytest.raises(ConfigError, match="block_tokens=16"):
        parse_layout("layers=32,kv_heads=8,head_dim=128,block_tokens=16", 512)


# ----------------------------------------------------------------------------- finding 6 (brief 7)


@pytest.mark.parametrize("given,missing", [("remote->dram", "dram->remote"), ("dram->remote", "remote->dram")])
def test_a_profile_with_one_network_link_is_refused_naming_the_other(tmp_path, given, missing):
    path = _profile_file(tmp_path, lambda data: data["links"].__setitem__(given, {"bandwidth_Bps": 46e9, "latency_s": 5e-6}))
    with pytest.raises(UserError) as info:
        load_profile(str(path))
    assert str(path) in str(info.value) and f"links[{missing!r}] is missing" in str(info.value)


def test_a_profile_with_both_network_links_keeps_them(tmp_path):
    link = {"bandwidth_Bps": 46e9, "latency_s": 5e-6}
    path = _profile_file(tmp_path, lambda data: data["links"].update({"remote->dram": link, "dram->remote": link}))
    profile = load_profile(str(path))
    assert profile.links["remote->dram"].bandwidth_Bps == profile.links["dram->remote"].bandwidth_Bps == 46e9
