"""Probe q30, finding 1: a durable block that a quantised tier cannot encode falls back onto
its retained NVMe copy instead of being dropped; without a retained copy it is still lost."""

import torch

from tiercache import TieredKVStore
from tiercache.config import KVLayout, TierConfig

LAYOUT = KVLayout(layers=1, kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=64)
PLAIN = [TierConfig("hbm", 1), TierConfig("dram", 1), TierConfig("nvme", 16)]


def _blocks(n: int) -> tuple[list[bytes], torch.Tensor]:
    """``n`` keys and bf16 blocks; block 2 holds 1e6, beyond what INT4 can encode."""
    torch.manual_seed(30)
    blocks = torch.randn(n, *LAYOUT.block_shape).bfloat16()
    blocks[2, 0, 1, 0, 5, 7] = 1e6
    return [bytes([i]) * 16 for i in range(n)], blocks


def _lost(store: TieredKVStore) -> dict[str, int]:
    return {t["name"]: t["lost"] for t in store.stats()["tiers"]}


def _plain_store(path, keys, blocks) -> None:
    with TieredKVStore(LAYOUT, PLAIN, path=str(path)) as store:
        store.put(keys, blocks)


def test_unencodable_block_read_up_out_of_nvme_falls_back_onto_its_retained_copy(tmp_path):
    keys, blocks = _blocks(6)
    _plain_store(tmp_path, keys, blocks)
    tiers = [TierConfig("hbm", 1), TierConfig("dram", 1, codec="int4"), TierConfig("nvme", 16)]
    with TieredKVStore(LAYOUT, tiers, path=str(tmp_path)) as store:
        assert torch.equal(store.get([keys[2]])[0], blocks[2])
        store.get([keys[0]])  # pushes block 2 out of HBM: INT4 DRAM refuses it
        assert store.lookup([keys[2]])[1] == ["nvme"]
        assert _lost(store) == {"hbm": 0, "dram": 0, "nvme": 0}
        assert store.stats()["retained_takeups"]["hbm->nvme"]["demotions"] == 1
        assert torch.equal(store.get([keys[2]])[0], blocks[2])
        store.check_invariants()
    with TieredKVStore(LAYOUT, PLAIN, path=str(tmp_path)) as store:
        assert store.lookup(keys)[1] == ["nvme"] * 6
        assert torch.equal(store.get([keys[2]])[0], blocks[2])


def test_unencodable_block_without_a_retained_copy_is_still_dropped_as_lost(tmp_path):
    keys, blocks = _blocks(6)
    _plain_store(tmp_path, keys, blocks)
    new_keys = [bytes([100 + i]) * 16 for i in range(4)]
    new_blocks = torch.randn(4, *LAYOUT.block_shape).bfloat16()
    tiers = [TierConfig("hbm", 2), TierConfig("dram", 1, codec="int4"), TierConfig("nvme", 6)]
    with TieredKVStore(LAYOUT, tiers, path=str(tmp_path)) as store:
        store.get([keys[2]])  # retained in NVMe: its one free slot
        for k, b in zip(new_keys, new_blocks):
            store.put([k], b[None])
            store.get([keys[2]])  # keeps block 2 in HBM while the new blocks push down
        assert store.engine.retained.held_in(2) == []  # new blocks written to NVMe took its room
        store.get([new_keys[-1]])  # block 2 is now the least recently used in HBM
        where = store.lookup(keys + new_keys)[1]
        assert where[2] == "hbm" and where[-1] == "hbm"
        store.get([(keys + new_keys)[where.index("nvme")]])  # pushes block 2 out: INT4 refuses it
        assert store.lookup([keys[2]])[1] == [None]
        assert _lost(store)["hbm"] == 1
        store.check_invariants()
    with TieredKVStore(LAYOUT, PLAIN, path=str(tmp_path)) as store:
        assert store.lookup([keys[2]])[1] == [None]
