"""Link/cost model: arithmetic, presets, profile files and their errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tiercache.errors import UserError
from tiercache.sim.hardware import PRESETS, REQUIRED_LINKS, HardwareProfile, Link, load_profile, save_profile


def _links(**overrides: Link) -> dict[str, Link]:
    links = {name: Link(1e9, 1e-5) for name in REQUIRED_LINKS}
    links.update({k.replace("_to_", "->"): v for k, v in overrides.items()})
    return links


def test_link_seconds():
    link = Link(bandwidth_Bps=10e9, latency_s=20e-6)
    assert link.seconds(0) == pytest.approx(20e-6)
    assert link.seconds(10e9) == pytest.approx(1 + 20e-6)
    assert link.seconds(1e9, ntransfers=4) == pytest.approx(0.1 + 80e-6)
    assert link.seconds(0, ntransfers=0) == 0
    with pytest.raises(ValueError):
        link.seconds(-1)


@pytest.mark.parametrize("bandwidth,latency", [(0, 0), (-1, 0), (1e9, -1), (float("inf"), 0), (True, 0), ("1e9", 0)])
def test_link_validation(bandwidth, latency):
    with pytest.raises(UserError):
        Link(bandwidth, latency)


def test_staged_nvme_to_hbm_is_sum_of_hops():
    profile = HardwareProfile("p", _links(nvme_to_dram=Link(5e9, 1e-4), dram_to_hbm=Link(50e9, 1e-5)), 1000)
    nbytes = 1e9
    expected = profile.seconds("nvme->dram", nbytes) + profile.seconds("dram->hbm", nbytes)
    assert profile.seconds("nvme->hbm", nbytes) == pytest.approx(expected)
    assert profile.seconds("hbm->nvme", nbytes) == pytest.approx(2 * (1e-5 + 1.0))
    with pytest.raises(KeyError):
        profile.link("nvme->hbm")  # staged, not a real link


def test_explicit_direct_path_wins():
    profile = HardwareProfile("gds", _links(nvme_to_hbm=Link(6e9, 5e-5)), 1000)
    assert profile.seconds("nvme->hbm", 6e9) == pytest.approx(1 + 5e-5)


def test_profile_validation():
    with pytest.raises(UserError, match="missing links"):
        HardwareProfile("p", {"dram->hbm": Link(1, 0)}, 1)
    with pytest.raises(UserError, match="unknown links"):
        HardwareProfile("p", _links(**{"hbm_to_hbm": Link(1, 0)}), 1)
    with pytest.raises(UserError, match="prefill_tokens_per_s"):
        HardwareProfile("p", _links(), 0)


def test_profile_is_frozen_and_links_read_only():
    profile = PRESETS["h200-pcie5-nvme4"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.name = "x"
    with pytest.raises(TypeError):
        profile.links["dram->hbm"] = Link(1, 0)
    hash(profile)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_load_and_round_trip(tmp_path, name):
    profile = load_profile(name)
    assert profile.name == name and set(REQUIRED_LINKS) <= set(profile.links)
    assert profile.seconds("nvme->hbm", 1e9) > profile.seconds("dram->hbm", 1e9)
    path = tmp_path / f"{name}.json"
    save_profile(profile, path)
    assert load_profile(str(path)) == profile
    assert load_profile(path) == profile


def test_preset_numbers():
    h200 = PRESETS["h200-pcie5-nvme4"]
    assert h200.link("dram->hbm") == Link(55e9, 10e-6)
    assert h200.link("nvme->dram") == Link(7e9, 80e-6) and h200.link("dram->nvme") == Link(5e9, 80e-6)
    assert PRESETS["gh200-c2c-nvme5"].link("dram->hbm").bandwidth_Bps == 450e9


def test_unknown_preset_lists_known():
    with pytest.raises(UserError) as info:
        load_profile("h900-magic")
    assert "'h900-magic'" in str(info.value)
    assert all(name in str(info.value) for name in PRESETS)


def _good_json() -> dict:
    return {
        "name": "box",
        "links": {n: {"bandwidth_Bps": 1e9, "latency_s": 1e-5} for n in REQUIRED_LINKS},
        "prefill_tokens_per_s": 1000,
    }


def _mutations():
    def drop(key):
        return lambda d: d.pop(key)

    def set_link(name, field, value):
        return lambda d: d["links"][name].__setitem__(field, value)

    return [
        (drop("prefill_tokens_per_s"), "prefill_tokens_per_s"),
        (drop("links"), "'links'"),
        (lambda d: d["links"].pop("dram->nvme"), "dram->nvme"),
        (set_link("dram->hbm", "bandwidth_Bps", -5), "links['dram->hbm'].bandwidth_Bps"),
        (set_link("nvme->dram", "latency_s", "fast"), "links['nvme->dram'].latency_s"),
        (lambda d: d["links"]["hbm->dram"].pop("latency_s"), "links['hbm->dram']"),
        (lambda d: d.__setitem__("prefill_tokens_per_s", False), "prefill_tokens_per_s"),
        (lambda d: d["links"].__setitem__("dram->ssd", {"bandwidth_Bps": 1, "latency_s": 0}), "dram->ssd"),
    ]


@pytest.mark.parametrize("mutate,fragment", _mutations())
def test_malformed_profile_names_file_and_field(tmp_path, mutate, fragment):
    data = _good_json()
    mutate(data)
    path = tmp_path / "box.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as info:
        load_profile(str(path))
    assert str(path) in str(info.value) and fragment in str(info.value)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_unparsable_profile_names_file(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(UserError, match="bad.json"):
        load_profile(str(path))


def test_save_to_missing_directory(tmp_path):
    with pytest.raises(UserError, match="cannot write"):
        save_profile(PRESETS["a100-pcie4-nvme4"], tmp_path / "no" / "p.json")


def test_save_that_fails_part_way_keeps_the_previous_profile(tmp_path, monkeypatch):
    """A failed write (a full disk) leaves an earlier profile file whole: it is written to a
    temporary file and renamed over the old one."""
    path = tmp_path / "p.json"
    save_profile(PRESETS["a100-pcie4-nvme4"], path)
    before = path.read_bytes()

    def full_disk(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tiercache.results.outfile.os.write", full_disk)
    with pytest.raises(UserError, match="cannot write"):
        save_profile(PRESETS["h200-pcie5-nvme4"], path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]
