"""Probe Q40 (a decode cache's recorded steps replayed): with ``write_through=True`` and an
admission policy other than ``always`` a sequence's blocks whose lower copies were refused could
only stay in HBM (write-through drops victims), so held blocks pinned it: an append that fit
(2 blocks held, 38 NVMe slots free) was refused, and the refused append's counters, never
recorded, made every replay of the run differ from it (hits, inserts, bytes). The decode cache
refuses that combination; either half alone replays exactly."""

from __future__ import annotations

import pytest
import torch

from tiercache import TieredKVCache
from tiercache.config import KVLayout, TierConfig
from tiercache.errors import UserError

LAYOUT = KVLayout(layers=1, kv_heads=2, head_dim=8, dtype="float32", block_tokens=2)


def _tiers(admission: str = "always") -> list[TierConfig]:
    return [TierConfig("hbm", 2), TierConfig("nvme", 40, admission=admission)]


@pytest.mark.parametrize("how", ["argument", "tier"])
@pytest.mark.parametrize("admission", ["tinylfu", "second_hit"])
def test_write_through_with_a_selective_admission_is_refused(tmp_path, how, admission):
    options = {"admission": admission} if how == "argument" else {}
    tiers = _tiers() if how == "argument" else _tiers(admission)
    with pytest.raises(UserError, match=rf"write_through=True with admission {admission}: "):
        TieredKVCache(LAYOUT, tiers, path=tmp_path / "nvme", device="cpu", write_through=True, **options)
    assert not (tmp_path / "nvme").exists()  # refused before anything opened


@pytest.mark.parametrize("write_through, admission", [(True, "always"), (False, "tinylfu")])
def test_either_half_alone_appends_every_block_that_fits(tmp_path, write_through, admission):
    with TieredKVCache(LAYOUT, _tiers(), admission=admission, path=tmp_path / "nvme", device="cpu",
                       write_through=write_through) as cache:
        seq = cache.sequence()
        g = torch.Generator().manual_seed(40)
        for _ in range(12):  # 12 blocks held, HBM holds 2
            seq.append(0, torch.randn(2, 2, 8, generator=g), torch.randn(2, 2, 8, generator=g))
            seq.attend(0, torch.randn(2, 1, 8, generator=g))
        assert seq.length(0) == 24
        seq.free()


def test_a_recorded_run_is_not_replayed_under_write_through_with_a_selective_admission(tmp_path, capsys):
    from tiercache.cli import main

    record = tmp_path / "steps.jsonl"
    with TieredKVCache(LAYOUT, _tiers(), admission="tinylfu", path=tmp_path / "nvme", device="cpu",
                       record=record) as cache:
        seq = cache.sequence()
        g = torch.Generator().manual_seed(41)
        for _ in range(4):
            seq.append(0, torch.randn(2, 2, 8, generator=g), torch.randn(2, 2, 8, generator=g))
            seq.attend(0, torch.randn(2, 1, 8, generator=g))
        seq.free()
    argv = ["replay", str(record), "--tiers", "hbm=2,nvme=40", "--workers", "1", "--no-progress"]
    assert main(argv + ["--admission", "tinylfu"]) == 0
    assert main(argv + ["--admission", "tinylfu", "--write-through"]) == 2
    err = capsys.readouterr().err
    assert "--write-through with --admission tinylfu: the decode cache refuses that hierarchy" in err


def test_an_admit_all_policy_by_module_path_passes_and_an_unknown_name_is_named(tmp_path):
    """Review R23: the check went by name (an admit-all module:Class was refused) and ran
    before the names were checked (a typo was told it was a write-through problem)."""
    from tiercache.policies import PolicyError

    with TieredKVCache(LAYOUT, _tiers(), admission="tiercache.policies.admission_always:AlwaysAdmit",
                       path=tmp_path / "nvme", device="cpu", write_through=True):
        pass
    with pytest.raises(PolicyError, match="unknown admission policy 'bogus'"):
        TieredKVCache(LAYOUT, _tiers(), admission="bogus", path=tmp_path / "other", device="cpu", write_through=True)


def test_a_step_trace_whose_records_hold_nothing_replays_under_write_through_with_any_admission(tmp_path):
    """Review R23: the replay refused any trace with decode fields; only holds pin HBM."""
    import json

    from tiercache.cli import main

    trace = tmp_path / "ahead.jsonl"
    lines = ['{"block_tokens": 2}'] + [json.dumps({"step": s, "layer": 0, "read": list(range(s)), "write": [s],
                                                  "ahead": list(range(min(s, 2)))}) for s in range(8)]
    trace.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(trace), "--tiers", "hbm=2,nvme=40", "--workers", "1", "--no-progress",
                 "--admission", "tinylfu", "--write-through"]) == 0


def test_a_subclass_of_always_admit_that_may_refuse_is_refused_and_a_list_is_named(tmp_path, monkeypatch):
    """Review R24: an ``AlwaysAdmit`` subclass overriding ``admit`` passed the check; an
    unhashable ``TierConfig.admission`` raised a bare TypeError."""
    import sys
    import types

    from tiercache.policies import PolicyError
    from tiercache.policies.admission_always import AlwaysAdmit

    module = types.ModuleType("q40_picky")

    class Picky(AlwaysAdmit):
        def admit(self, *args, **kwargs):  # refuses every block
            return False

    module.Picky = Picky
    monkeypatch.setitem(sys.modules, "q40_picky", module)
    with pytest.raises(UserError, match="write_through=True with admission q40_picky:Picky"):
        TieredKVCache(LAYOUT, _tiers(), admission="q40_picky:Picky", path=tmp_path / "a", device="cpu",
                      write_through=True)
    with pytest.raises(PolicyError, match=r"admission policy must be a name \(a str\), got list"):
        TieredKVCache(LAYOUT, [TierConfig("hbm", 2), TierConfig("nvme", 40, admission=["x"])],
                      path=tmp_path / "b", device="cpu", write_through=True)
