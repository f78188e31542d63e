"""Probe r14: a live append that has room (fewer blocks held than the tiers hold) is stored,
even when the one unheld block sits in HBM above tiers full of held blocks: that block leaves
the hierarchy (an eviction) instead of the append failing with a RuntimeError."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tiercache import AttentionMode, TieredKVCache
from tiercache.cli import main as cli_main
from tiercache.config import KVLayout, TierConfig
from tiercache.errors import UserError

LAYOUT = KVLayout(1, 1, 8, "float32", 1)  # one layer, one token per block: one token appends one block


def _tiers(hbm: int, dram: int, nvme: int) -> list[TierConfig]:
    return [TierConfig("hbm", hbm), TierConfig("dram", dram), TierConfig("nvme", nvme)]


def _append(seq, g: torch.Generator, blocks: int) -> None:
    seq.append(0, torch.randn(1, blocks, 8, generator=g), torch.randn(1, blocks, 8, generator=g))


def _tier_counts(stats: dict) -> list[list[int]]:
    return [[t[k] for t in stats["tiers"]] for k in ("hits", "promotions", "inserts", "evictions")]


def test_an_unheld_hbm_block_leaves_when_the_tiers_below_are_full_of_held_blocks(tmp_path):
    g = torch.Generator().manual_seed(0)
    record = tmp_path / "steps.jsonl"
    with TieredKVCache(LAYOUT, _tiers(2, 1, 1), path=tmp_path / "nvme", device="cpu", prefetch="none",
                       record=str(record)) as cache:
        a = cache.sequence()
        _append(a, g, 3)  # HBM [a1, a2], DRAM [a0]
        x = cache.sequence()
        _append(x, g, 1)  # a1 pushes a0 to NVMe: HBM [a2, x0], DRAM [a1], NVMe [a0]
        x.free()  # x0 is the one unheld block, in HBM; HBM's LRU victim a2 is held
        manager = cache.manager
        assert [len(d) for d in manager.dirs] == [2, 1, 1] and len(manager.held) == 3
        evicted = sum(t["evictions"] for t in cache.stats()["tiers"])
        _append(a, g, 1)  # 3 of 4 held: room for one more
        assert a.length() == 4
        assert all(manager.locate(int(b)) is not None for b in a._layers[0].ids[: a._layers[0].n])
        assert len(manager.held) == 4 and sum(len(d) for d in manager.dirs) == 4
        assert sum(t["evictions"] for t in cache.stats()["tiers"]) == evicted + 1  # x0 left, counted
        manager.check_invariants()
        with pytest.raises(UserError, match="do not fit"):  # every slot held: the documented refusal
            _append(a, g, 1)
        a.attend(0, torch.randn(1, 1, 8, generator=g))  # reads every block where it lies
        live = _tier_counts(cache.stats())
        assert live[0] == [2, 1, 1] and live[3] == [1, 0, 0]  # x0 left from HBM, as an eviction
    out = tmp_path / "replay.json"
    assert cli_main(["replay", str(record), "--tiers", "hbm=2,dram=1,nvme=1", "--out", str(out), "--no-progress"]) == 0
    assert _tier_counts(json.loads(out.read_text())["runs"][0]) == live


@pytest.mark.parametrize("seed", range(4))
def test_appends_and_frees_with_most_blocks_held_never_fail_for_want_of_room(tmp_path, seed):
    """Random appends (1 to 3 blocks), frees and reads over 3 small tiers kept nearly full of
    held blocks: an append is refused only with the documented ``UserError`` when the held
    blocks and its own outnumber the slots, every held block stays resident, the manager's
    invariants hold after each call, and the recorded run replays to the same counts."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    tiers = [rng.randint(1, 4), rng.randint(1, 3), rng.randint(2, 8)]
    record = tmp_path / "steps.jsonl"
    with TieredKVCache(LAYOUT, _tiers(*tiers), path=tmp_path / "nvme", device="cpu", prefetch="topk_speculative",
                       record=str(record)) as cache:
        seqs, capacity = [cache.sequence()], cache.capacity_blocks
        for _ in range(150):
            held, roll = len(cache.manager.held), rng.random()
            if len(seqs) > 1 and (held >= capacity or roll < 0.12):
                seqs.pop(rng.randrange(len(seqs))).free()
            elif roll < 0.2:
                seqs.append(cache.sequence())
            elif roll < 0.35 and rng.choice(seqs).blocks():
                seq = max(seqs, key=lambda s: s.blocks())
                mode = rng.choice([AttentionMode.EXACT, AttentionMode.SPARSE])
                seq.attend(0, torch.randn(1, 1, 8, generator=g), mode, None if mode is AttentionMode.EXACT else 2)
            else:
                blocks = rng.randint(1, 3)
                try:
                    _append(rng.choice(seqs), g, blocks)
                except UserError:  # the documented refusal, only where the blocks do not fit
                    assert held + blocks > capacity
            cache.manager.check_invariants()
            assert all(cache.manager.locate(int(b)) is not None for s in seqs for b in s._layers[0].ids[: s._layers[0].n])
        live = _tier_counts(cache.stats())
    assert sum(live[3]) > 0  # blocks left the hierarchy
    out = tmp_path / "replay.json"
    layout = ",".join(f"{t}={c}" for t, c in zip(("hbm", "dram", "nvme"), tiers))
    assert cli_main(["replay", str(record), "--tiers", layout, "--prefetch", "topk_speculative", "--out", str(out),
                     "--no-progress"]) == 0
    assert _tier_counts(json.loads(out.read_text())["runs"][0]) == live
