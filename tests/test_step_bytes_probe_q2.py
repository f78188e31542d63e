"""Probe Q2 findings 2 and 4 on the decode loop's figures.

F2: ``StepReport.bytes_moved`` charged each block read from a lower tier at that tier's stored
size and each prefetched one at HBM's, while ``stats()["bytes_moved"]`` charges a link by what
crosses it (``traffic.link_block_bytes``): with a quantised tier the steps' sum disagreed with
the links into HBM (int4 NVMe: 509,840 vs 794,624 bytes over 12 sparse steps). Both now use the
one rule, so the reports of reads sum to the growth of the links into HBM.

F4: every block an exact step streamed in place counted as ``promote_skipped`` in its tier,
though no promotion was tried (``promote_skipped`` is a promotion or prefetch no room could be
made for). A read in place by choice is now its own event (``Ev.READ_IN_PLACE``): it counts in
``hits_in_place``, never in ``promote_skipped``.
"""

from __future__ import annotations

import json

import pytest
import torch

from tiercache import AttentionMode, TieredKVCache
from tiercache.cli import main as cli_main
from tiercache.config import KVLayout, TierConfig
from tiercache.core.manager import TierManager
from tiercache.core.stats import HierarchyStats, InPlaceHits
from tiercache.policies import PlacementPolicy, make_admission, make_eviction

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
BLOCK = 2 * 2 * 16 * 64 * 2  # one layer's block, K and V, fp16: 8192 bytes
INT4, INT8 = 2608, 4560  # the same block stored int4 / int8, scales included


def _kv(gen: torch.Generator, tokens: int) -> torch.Tensor:
    return torch.randn(LAYOUT.kv_heads, tokens, LAYOUT.head_dim, generator=gen).half()


def _cache(tmp_path, codecs, hbm=4, dram=6, prefetch="topk_speculative", record=None) -> TieredKVCache:
    caps = {"hbm": hbm, "dram": dram, "nvme": 100}
    tiers = [TierConfig(name, cap) if codec is None else TierConfig(name, cap, codec=codec)
             for (name, cap), codec in zip(caps.items(), codecs)]
    return TieredKVCache(LAYOUT, tiers, prefetch=prefetch, path=tmp_path / "nvme", device="cpu", window_blocks=4,
                         record=record)


def _into_hbm(stats: dict) -> int:
    return sum(n for link, n in stats["bytes_moved"].items() if link.endswith("->hbm"))


def _tiers(cache: TieredKVCache) -> dict[str, dict]:
    return {t["name"]: t for t in cache.stats()["tiers"]}


# -- F2: a step's bytes are its reads' and prefetches' bytes on their links to HBM ----------------
@pytest.mark.parametrize("codecs", [(None, None, None), ("int8", None, None), (None, "int8", None),
                                    (None, "int4", None), (None, None, "int4")],
                         ids=["plain", "hbm-int8", "dram-int8", "dram-int4", "nvme-int4"])
def test_step_reports_sum_to_the_growth_of_the_links_into_hbm(tmp_path, codecs):
    """Sparse steps (promotions, prefetches) and exact ones (reads in place): whatever tier is
    quantised, the steps' ``bytes_moved`` add up to what ``stats()`` charged on the links into HBM."""
    gen = torch.Generator().manual_seed(8)
    with _cache(tmp_path, codecs) as cache:
        seq = cache.sequence()
        for layer in range(LAYOUT.layers):
            seq.append(layer, _kv(gen, 30 * 16), _kv(gen, 30 * 16))
        reported, charged = 0, 0
        for step in range(6):
            for layer in range(LAYOUT.layers):
                seq.append(layer, _kv(gen, 1), _kv(gen, 1))
                before = _into_hbm(cache.stats())
                q = torch.randn(4, 1, LAYOUT.head_dim, generator=gen).half()
                if step % 3 == 2:
                    seq.attend(layer, q)
                else:
                    seq.attend(layer, q, AttentionMode.SPARSE, budget=0.2)
                charged += _into_hbm(cache.stats()) - before
                reported += seq.reports[-1].bytes_moved
                assert seq.reports[-1].bytes_moved == _into_hbm(cache.stats()) - before, (step, layer)
        assert sum(r.prefetched for r in seq.reports) > 0 and charged > 0
        assert reported == charged


def test_an_exact_step_charges_an_int4_nvme_block_as_it_arrives_in_hbm(tmp_path):
    """One exact step over blocks in HBM, DRAM and an int4 NVMe tier: each block below HBM
    crosses to HBM decoded (8192 bytes), not at NVMe's stored 2608, as the link counts it."""
    gen = torch.Generator().manual_seed(8)
    with _cache(tmp_path, (None, None, "int4"), hbm=2, dram=2, prefetch="none") as cache:
        seq = cache.sequence()
        seq.append(0, _kv(gen, 6 * 16), _kv(gen, 6 * 16))
        before = cache.stats()["bytes_moved"]
        seq.attend(0, torch.randn(2, 1, LAYOUT.head_dim, generator=gen).half())
        after = cache.stats()["bytes_moved"]
        report = seq.reports[-1]
    assert (report.hbm_hits, report.from_dram, report.from_nvme) == (2, 2, 2)
    assert report.bytes_moved == 4 * BLOCK == 32768
    assert after["nvme->hbm"] - before.get("nvme->hbm", 0) == 2 * BLOCK
    assert after["dram->hbm"] - before.get("dram->hbm", 0) == 2 * BLOCK


def test_a_step_over_an_int8_hbm_charges_the_encoded_bytes_that_cross(tmp_path):
    """With an int8 HBM a plain DRAM or NVMe block is encoded before it crosses: 4560 bytes each."""
    gen = torch.Generator().manual_seed(8)
    with _cache(tmp_path, ("int8", None, None), hbm=2, dram=2, prefetch="none") as cache:
        seq = cache.sequence()
        seq.append(0, _kv(gen, 6 * 16), _kv(gen, 6 * 16))
        seq.attend(0, torch.randn(2, 1, LAYOUT.head_dim, generator=gen).half())
        report = seq.reports[-1]
    assert (report.from_dram, report.from_nvme) == (2, 2) and report.bytes_moved == 4 * INT8


# -- F4: an exact step's streamed reads are not skipped promotions --------------------------------
def test_an_exact_step_reads_in_place_without_counting_skipped_promotions(tmp_path):
    gen = torch.Generator().manual_seed(5)
    with _cache(tmp_path, (None, None, None), hbm=2, dram=2, prefetch="none") as cache:
        seq = cache.sequence()
        seq.append(0, _kv(gen, 6 * 16), _kv(gen, 6 * 16))
        seq.attend(0, torch.randn(2, 1, LAYOUT.head_dim, generator=gen).half())
        report, tiers = seq.reports[-1], _tiers(cache)
    assert (report.from_dram, report.from_nvme) == (2, 2)
    for name, found in (("dram", 2), ("nvme", 2)):
        tier = tiers[name]
        assert (tier["hits"], tier["hits_in_place"], tier["in_place_bytes"]) == (found, found, found * BLOCK), name
        assert tier["promotions"] == 0 and tier["promote_skipped"] == 0, name


def test_a_promotion_that_finds_no_room_still_counts_as_skipped(tmp_path):
    """A sparse step of more blocks than HBM holds tries to promote them: those it cannot are
    read in place and counted in ``promote_skipped`` (the label's meaning), exactly those."""
    gen = torch.Generator().manual_seed(5)
    with _cache(tmp_path, (None, None, None), hbm=1, dram=1, prefetch="none") as cache:
        seq = cache.sequence()
        seq.append(0, _kv(gen, 4 * 16), _kv(gen, 4 * 16))
        seq.attend(0, torch.randn(2, 1, LAYOUT.head_dim, generator=gen).half())  # exact: in place, none skipped
        assert all(t["promote_skipped"] == 0 for t in _tiers(cache).values())
        seq.attend(0, torch.randn(2, 1, LAYOUT.head_dim, generator=gen).half(), AttentionMode.SPARSE, budget=4)
        tiers = _tiers(cache)
    assert [tiers[n]["promote_skipped"] for n in ("hbm", "dram", "nvme")] == [0, 1, 2]
    assert [tiers[n]["hits_in_place"] for n in ("dram", "nvme")] == [2, 4]


class _Stay(PlacementPolicy):
    """Keeps new blocks on top and every hit where it lies."""

    name = "stay"

    def insert_tier(self, ids, hints=None) -> int:
        return 0

    def promote_tier(self, ids, tier, hints=None) -> int:
        return tier


@pytest.mark.parametrize("how", ["streaming", "placement"])
def test_a_manager_read_in_place_by_choice_is_a_hit_in_place_not_a_skipped_promotion(how):
    placement = _Stay(3) if how == "placement" else None
    manager = TierManager([("hbm", 2), ("dram", 2), ("nvme", 8)], [make_eviction("lru", c) for c in (2, 2, 8)],
                          [make_admission("always")] * 3, placement=placement)
    manager.access(list(range(6)))  # 4, 5 in HBM; 2, 3 in DRAM; 0, 1 on NVMe
    manager.events.drain()
    manager.access(list(range(6)), promote=how != "streaming")
    events = manager.events.drain()
    counters = HierarchyStats.for_tiers([(d.name, d.capacity) for d in manager.dirs])
    counters.consume(events)
    in_place = InPlaceHits.for_tiers(3)
    in_place.consume(events)
    assert [t.hits for t in counters.tiers] == [2, 2, 2] and in_place.counts == [2, 2, 2]
    assert [t.promote_skipped for t in counters.tiers] == [0, 0, 0]
    assert [t.promotions for t in counters.tiers] == [0, 0, 0]
    assert [manager.locate(b) for b in range(6)] == [2, 2, 1, 1, 0, 0]


def test_a_replay_of_exact_steps_counts_them_in_place_as_the_live_store_did(tmp_path):
    """The recorded trace replays to the live counts: reads in place, and no skipped promotion."""
    record = tmp_path / "steps.jsonl"
    gen = torch.Generator().manual_seed(5)
    with _cache(tmp_path, (None, None, None), hbm=2, dram=2, prefetch="none", record=record) as cache:
        seq = cache.sequence()
        for layer in range(LAYOUT.layers):
            seq.append(layer, _kv(gen, 6 * 16), _kv(gen, 6 * 16))
        for layer in range(LAYOUT.layers):
            seq.attend(layer, torch.randn(2, 1, LAYOUT.head_dim, generator=gen).half())
        live = cache.stats()["tiers"]
    out = tmp_path / "replay.json"
    assert cli_main(["replay", str(record), "--tiers", "hbm=2,dram=2,nvme=100", "--prefetch", "none",
                     "--layout", "layers=1,kv_heads=2,head_dim=64,dtype=float16", "--out", str(out), "--no-progress"]) == 0
    replayed = json.loads(out.read_text())["runs"][0]["tiers"]
    for key in ("hits", "hits_in_place", "promote_skipped", "promotions"):
        assert [t[key] for t in live] == [t[key] for t in replayed], key
    assert sum(t["hits_in_place"] for t in live[1:]) > 0 and all(t["promote_skipped"] == 0 for t in live)
