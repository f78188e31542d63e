"""Probe S findings on the live store and the decode loop: the live ``bytes_moved`` left out
every read done in place (a replay of the very trace it recorded charged them), a read whose
prefetch policy raised was not recorded though its reads and promotions had happened, and a
store refused after its media opened left its NVMe folder locked."""

from __future__ import annotations

import json

import pytest
import torch

from tiercache import AttentionMode, TieredKVCache, TieredKVStore
from tiercache.cli import main as cli_main
from tiercache.config import KVLayout, TierConfig
from tiercache.live.traffic import as_replay_charges
from tiercache.policies import PolicyError
from tiercache.policies.base import PrefetchPolicy
from tiercache.policies.lru import LRU

HERE = __name__  # the module the out-of-tree policies below are loaded from
LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="float16", block_tokens=8)
REPLAY_LAYOUT = "layers=1,kv_heads=2,head_dim=16,dtype=float16"  # the cache's blocks are per layer


class Raising(PrefetchPolicy):
    """A prefetch policy that raises every time it is asked (after the read's blocks were read)."""

    name = "raising"

    def plan(self, view):
        raise ValueError("raising: no plan")


class RefusesToReopen(LRU):
    """An eviction policy that raises when blocks are adopted on reopen (after the media opened)."""

    def on_insert(self, ids, hints=None):
        raise RuntimeError("refuses to adopt blocks")


def _tiers(nvme_codec: str | None = None) -> list[TierConfig]:
    nvme = TierConfig("nvme", 200) if nvme_codec is None else TierConfig("nvme", 200, codec=nvme_codec)
    return [TierConfig("hbm", 6), TierConfig("dram", 10), nvme]


def _kv(gen: torch.Generator, tokens: int) -> torch.Tensor:
    return torch.randn(LAYOUT.kv_heads, tokens, LAYOUT.head_dim, generator=gen).half()


def _decode(cache: TieredKVCache, steps: int, exact_every: int = 2) -> int:
    """A sequence of 30 blocks per layer, then ``steps`` decode steps, sparse and exact in
    turn; returns how many attends raised ``ValueError`` (a prefetch policy's)."""
    gen = torch.Generator().manual_seed(3)
    seq = cache.sequence()
    for layer in range(LAYOUT.layers):
        seq.append(layer, _kv(gen, 30 * LAYOUT.block_tokens), _kv(gen, 30 * LAYOUT.block_tokens))
    failed = 0
    for step in range(steps):
        for layer in range(LAYOUT.layers):
            seq.append(layer, _kv(gen, 1), _kv(gen, 1))
            q = torch.randn(4, 1, LAYOUT.head_dim, generator=gen).half()
            try:
                if step % exact_every:
                    seq.attend(layer, q)
                else:
                    seq.attend(layer, q, AttentionMode.SPARSE, budget=0.25)
            except ValueError:
                failed += 1
    seq.free()
    return failed


def _replay(tmp_path, record, tiers: str, prefetch: str) -> dict:
    out = tmp_path / "replay.json"
    code = cli_main(["replay", str(record), "--tiers", tiers, "--prefetch", prefetch, "--layout", REPLAY_LAYOUT,
                     "--out", str(out), "--no-progress"])
    assert code == 0
    return json.loads(out.read_text())["runs"][0]


# -- F1: bytes_moved counts reads in place, as a replay charges them ------------------------------
@pytest.mark.parametrize("nvme_codec", [None, "int4"])
def test_live_bytes_moved_per_link_equals_the_replay_of_its_own_trace(tmp_path, nvme_codec):
    """Exact steps stream every block where it lies (nothing promoted) and sparse steps promote;
    each link's bytes, and each tier's hits read in place with their bytes, are what the replay
    of the recorded trace charges (a quantised NVMe tier's blocks arrive in HBM decoded)."""
    record = tmp_path / "steps.jsonl"
    with TieredKVCache(LAYOUT, _tiers(nvme_codec), prefetch="topk_speculative", path=tmp_path / "nvme", device="cpu",
                       record=record, window_blocks=4) as cache:
        _decode(cache, steps=6)
        live, block_bytes = cache.stats(), cache.layout.block_bytes  # per layer
    tiers = "hbm=6,dram=10,nvme=200" + (f":{nvme_codec}" if nvme_codec else "")
    run = _replay(tmp_path, record, tiers, "topk_speculative")
    assert as_replay_charges(live) == run["bytes_moved"]  # demotions taken up from a retained NVMe copy write nothing
    for mine, replayed in zip(live["tiers"], run["tiers"]):
        assert (mine["hits"], mine["hits_in_place"], mine["in_place_bytes"]) == \
            (replayed["hits"], replayed["hits_in_place"], replayed["in_place_bytes"]), mine["name"]
    nvme = live["tiers"][2]
    assert nvme["hits_in_place"] > nvme["promotions"] >= 0 and nvme["in_place_bytes"] == nvme["hits_in_place"] * block_bytes
    assert live["bytes_moved"]["nvme->hbm"] >= nvme["in_place_bytes"]


def test_a_get_that_cannot_promote_counts_its_read_in_place_on_the_link(tmp_path):
    """``TieredKVStore.get`` of more blocks than HBM holds reads the rest where they lie: they
    cross to HBM all the same, and the link counts them."""
    layout = KVLayout(layers=1, kv_heads=2, head_dim=16, dtype="float16", block_tokens=8)
    blocks = torch.randn(6, *layout.block_shape).half()
    keys = [bytes([i]) * 16 for i in range(6)]
    with TieredKVStore(layout, [TierConfig("hbm", 2), TierConfig("dram", 8)], eviction="lru", device="cpu") as store:
        store.put(keys, blocks)
        before = store.stats()
        assert torch.equal(store.get(keys), blocks)
        after = store.stats()
    dram = after["tiers"][1]
    read_in_place = dram["hits_in_place"] - before["tiers"][1]["hits_in_place"]
    assert read_in_place == dram["promote_skipped"] > 0
    moved = after["bytes_moved"].get("dram->hbm", 0) - before["bytes_moved"].get("dram->hbm", 0)
    promoted = dram["promotions"] - before["tiers"][1]["promotions"]
    assert moved == (read_in_place + promoted) * layout.block_bytes


# -- F3 of the probe: a read whose prefetch policy raises is still recorded -------------------------
def test_a_read_whose_prefetch_policy_raises_is_recorded_and_replays_to_the_live_counts(tmp_path):
    """The policy raises after every read's blocks were read (hits counted, sparse promotions
    made); each read is in the trace, so its replay (no prefetch ever ran) counts the same."""
    record = tmp_path / "steps.jsonl"
    with TieredKVCache(LAYOUT, _tiers(), prefetch=f"{HERE}:Raising", path=tmp_path / "nvme", device="cpu",
                       record=record) as cache:
        failed = _decode(cache, steps=4)
        assert not cache.manager.refs and not cache.manager.held  # the failed reads took their references back
        live = cache.stats()
    assert failed == 4 * LAYOUT.layers
    records = [json.loads(line) for line in record.read_text().splitlines()[1:]]
    assert sum(1 for r in records if r.get("read")) == failed
    run = _replay(tmp_path, record, "hbm=6,dram=10,nvme=200", "none")
    for key in ("hits", "promotions", "promote_skipped"):
        assert [t[key] for t in live["tiers"]] == [t[key] for t in run["tiers"]], key
    assert sum(t["promotions"] for t in live["tiers"]) > 0


# -- F2 of the probe: a refused constructor leaves nothing open ------------------------------------
@pytest.mark.parametrize("cls", [TieredKVStore, TieredKVCache])
def test_a_store_refused_for_an_unknown_admission_policy_can_be_opened_again_at_once(tmp_path, cls):
    """The refused constructor's traceback (kept here, as an interactive session keeps the last
    one) must not hold the NVMe folder: the corrected call opens it."""
    with pytest.raises(PolicyError, match="unknown admission policy 'second_hitt'") as refused:
        cls(LAYOUT, _tiers(), admission="second_hitt", path=tmp_path / "nvme", device="cpu")
    with cls(LAYOUT, _tiers(), admission="second_hit", path=tmp_path / "nvme", device="cpu"):
        pass
    assert refused.value is not None


def test_a_store_that_fails_after_its_media_opened_closes_them(tmp_path):
    """Adopting the stored blocks on reopen runs the eviction policy: one that raises there
    stops the constructor after the NVMe store opened, which is closed again."""
    layout = KVLayout(layers=1, kv_heads=2, head_dim=16, dtype="float16", block_tokens=8)
    blocks = torch.randn(4, *layout.block_shape).half()
    keys = [bytes([i]) * 16 for i in range(4)]
    tiers = [TierConfig("hbm", 2), TierConfig("nvme", 8)]
    with TieredKVStore(layout, tiers, path=tmp_path / "nvme", device="cpu") as store:
        store.put(keys, blocks)
    with pytest.raises(RuntimeError, match="refuses to adopt blocks") as refused:
        TieredKVStore(layout, tiers, eviction=f"{HERE}:RefusesToReopen", path=tmp_path / "nvme", device="cpu")
    with TieredKVStore(layout, tiers, eviction="lru", path=tmp_path / "nvme", device="cpu") as store:
        assert torch.equal(store.get(keys), blocks)
    assert refused.value is not None
