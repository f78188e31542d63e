"""Placement policies (``--placement``): where new blocks and hits below the top go in an
exclusive hierarchy. The contract over the registry, the manager honouring (and checking)
the answers, the replay and CLI plumbing, and ``top`` being exactly the old behaviour."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tiercache.cli import main
from tiercache.config import TierConfig, layout_preset
from tiercache.core.manager import TierManager
from tiercache.errors import UserError
from tiercache.policies import PLACEMENT, PlacementPolicy, get_placement, make_admission, make_eviction, make_placement
from tiercache.results import Semantics
from tiercache.sim.hardware import PRESETS
from tiercache.sim.loader import load_trace
from tiercache.sim.replay import ReplayData, RunSpec, replay, use_kernels
from tiercache.sim.sweep import SweepSpec

HEAD = Path(__file__).parent / "data" / "mooncake_head.jsonl"
THREE = (TierConfig("hbm", 20), TierConfig("dram", 60), TierConfig("nvme", 200))


def _manager(placement: PlacementPolicy | None, caps=(2, 3, 8), policy: str = "lru") -> TierManager:
    names = ("hbm", "dram", "nvme")[: len(caps)]
    return TierManager(list(zip(names, caps)), [make_eviction(policy, c) for c in caps],
                       [make_admission("always") for _ in caps], placement=placement)


@pytest.mark.parametrize("name", sorted(PLACEMENT))
@pytest.mark.parametrize("tiers", [1, 2, 3])
def test_contract_answers_are_tiers_of_the_hierarchy(name, tiers) -> None:
    policy = make_placement(name, tiers)
    assert isinstance(policy, PlacementPolicy) and policy.name == name
    for ids in ([1], [2, 3, 4]):
        assert 0 <= policy.insert_tier(ids) < tiers
        for found in range(1, tiers):
            assert policy.promote_tier(ids, found) in (0, found)
    policy.check_invariants()
    with pytest.raises(ValueError):
        get_placement(name)(0)


def test_reuse_starts_new_blocks_one_tier_down_and_promotes_hits() -> None:
    manager = _manager(make_placement("reuse", 3))
    manager.access([1, 2, 3])
    assert [manager.locate(b) for b in (1, 2, 3)] == [1, 1, 1]
    manager.access([2])  # a hit in DRAM moves to the top
    assert manager.locate(2) == 0
    manager.access([4, 5, 6, 7])  # DRAM (3 blocks) overflows into NVMe; HBM keeps the reused block
    assert manager.locate(2) == 0 and sorted(manager.dirs[1].slot_of) == [5, 6, 7]
    manager.check_invariants()


class _InPlace(PlacementPolicy):
    name = "in_place"

    def insert_tier(self, ids, hints=None) -> int:
        return 0

    def promote_tier(self, ids, tier, hints=None) -> int:
        return tier


class _Wrong(_InPlace):
    name = "wrong"

    def promote_tier(self, ids, tier, hints=None) -> int:
        return 5


def test_a_hit_read_in_place_stays_and_counts_as_a_hit() -> None:
    manager = _manager(_InPlace(3))
    manager.access([1, 2, 3])  # HBM holds 2: block 1 goes down to DRAM
    assert manager.locate(1) == 1
    manager.access([1])
    assert manager.locate(1) == 1 and manager.dirs[1].slot_of.get(1) is not None
    manager.check_invariants()


def test_an_answer_outside_the_hierarchy_is_refused_by_name() -> None:
    manager = _manager(_Wrong(3))
    manager.access([1, 2, 3])
    with pytest.raises(ValueError, match="placement test_placement:_Wrong: promote_tier answered 5"):
        manager.access([1])


def test_placement_needs_an_exclusive_hierarchy() -> None:
    with pytest.raises(ValueError, match="exclusive"):
        TierManager([("hbm", 2), ("dram", 4)], [make_eviction("lru", 2), make_eviction("lru", 4)],
                     [make_admission("always")] * 2, write_through=True, placement=make_placement("reuse", 2))
    for cache in (None,):
        with pytest.raises(UserError, match="--placement reuse"):
            SweepSpec(("lru",), (Semantics.PREFIX,), (100,), cache, placement="reuse")
    with pytest.raises(UserError, match="unknown placement policy"):
        SweepSpec(("lru",), (Semantics.PREFIX,), (100,), placement="nowhere")


@pytest.fixture(scope="module")
def data() -> ReplayData:
    trace = load_trace(HEAD)
    return ReplayData.prepare(trace, layout_preset("llama-3-8b", trace.block_tokens), PRESETS["h200-pcie5-nvme4"])


@pytest.mark.parametrize("policy", ["lru", "session"])
def test_top_is_the_default_behaviour(data, policy, monkeypatch) -> None:
    """``top`` through the placement hook equals the manager without one (and the kernels)."""
    import tiercache.sim.replay as replay_module

    spec = RunSpec(policy, Semantics.PREFIX, THREE)
    plain = replay(spec, data)
    with monkeypatch.context() as patched:
        patched.setattr(replay_module, "use_kernels", lambda spec: False)
        patched.setattr(replay_module, "make_placement", lambda name, n: make_placement("top", n))
        built = replay_module.build_manager
        patched.setattr(replay_module, "build_manager", lambda s, d: _with_top(built, s, d))
        hooked = replay(spec, data)
    strip = lambda r: dataclasses.replace(r, wall_seconds=0.0)  # noqa: E731
    assert strip(hooked) == strip(plain)


def _with_top(build, spec, data):
    manager, engine = build(spec, data)
    manager.placement = make_placement("top", len(spec.tiers))
    return manager, engine


def test_reuse_replays_on_the_python_manager_and_charges_its_writes(data) -> None:
    top, reuse = RunSpec("lru", Semantics.PREFIX, THREE), RunSpec("lru", Semantics.PREFIX, THREE, placement="reuse")
    assert use_kernels(top) and not use_kernels(reuse)
    a, b = replay(top, data), replay(reuse, data)
    assert b.placement == "reuse" and b.label == "lru@reuse" and a.placement == "top"
    assert b.tiers[1].inserts > 0 and a.tiers[1].inserts == 0  # new blocks land in DRAM
    # every new block is written down from HBM, where it was computed
    assert b.bytes_moved["hbm->dram"] >= b.tiers[1].inserts * data.layout.block_bytes
    assert b.accesses == a.accesses and b.ttft_saved_s is not None


def test_cli_placement_is_recorded_and_refused_where_it_cannot_apply(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    code = main(["replay", str(HEAD), "--policy", "lru", "--semantics", "prefix", "--tiers", "hbm=20,dram=60,nvme=200",
                 "--placement", "reuse", "--no-progress", "--out", str(out)])
    assert code == 0, capsys.readouterr()
    assert json.loads(out.read_text())["runs"][0]["placement"] == "reuse"
    assert "lru@reuse" in capsys.readouterr().out
    for extra in (["--capacity", "100"], ["--tiers", "hbm=20,dram=60", "--write-through"],
                  ["--tiers", "hbm=20,remote=60", "--instances", "2"]):
        code = main(["replay", str(HEAD), "--policy", "lru", "--semantics", "prefix", "--placement", "reuse",
                     "--no-progress", *extra])
        err = capsys.readouterr().err
        assert code == 2 and "--placement reuse" in err and "Traceback" not in err, (extra, err)
