"""Probe Q52: a live ``prefetch`` never pushes one of the blocks it was asked for out of
the hierarchy.

On a full exclusive hierarchy a prefetch guarded only the run it was moving from one tier;
the cascade its room started could push another asked-for block, still waiting in the last
tier, out (19 of 300 random stores), and the ``get`` right after the prefetch raised
KeyError. The guard is now every id asked for.
"""

from __future__ import annotations

import random

import torch

from tiercache import TieredKVStore
from tiercache.config import KVLayout, TierConfig

LAYOUT = KVLayout(layers=1, kv_heads=1, head_dim=16, dtype="float16", block_tokens=4)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_a_prefetch_keeps_every_block_it_was_asked_for(tmp_path):
    tiers = [TierConfig("hbm", 1), TierConfig("dram", 1), TierConfig("nvme", 11)]
    data = torch.randn(13, *LAYOUT.block_shape, generator=torch.Generator().manual_seed(1)).half()
    with TieredKVStore(LAYOUT, tiers, eviction="fifo", path=tmp_path, device="cpu") as store:
        for i in range(13):  # every tier full, key 0 the oldest in NVMe (FIFO's next victim)
            store.put([_key(i)], data[i : i + 1])
        ask = [11, 6, 0, 9, 4]  # 11 up from DRAM pushes 12 down, and a block out of NVMe
        assert store.lookup([_key(i) for i in ask])[1] == ["dram", "nvme", "nvme", "nvme", "nvme"]
        store.wait(store.prefetch([_key(i) for i in ask]))
        assert None not in store.lookup([_key(i) for i in ask])[1]
        assert torch.equal(store.get([_key(i) for i in ask]), data[ask])


def test_random_full_hierarchies_never_lose_an_asked_block_to_its_prefetch(tmp_path):
    for seed in range(40):
        rng = random.Random(seed)
        caps = (rng.randint(1, 3), rng.randint(1, 3), rng.randint(4, 12))
        tiers = [TierConfig(name, c) for name, c in zip(("hbm", "dram", "nvme"), caps)]
        with TieredKVStore(LAYOUT, tiers, eviction=rng.choice(["lru", "fifo", "s3fifo"]),
                           path=tmp_path / str(seed), device="cpu") as store:
            keys = [_key(i) for i in range(sum(caps) + rng.randint(0, 4))]
            for k in keys:
                store.put([k], torch.zeros(1, *LAYOUT.block_shape, dtype=torch.float16))
            stored = [k for k, where in zip(keys, store.lookup(keys)[1]) if where]
            ask = rng.sample(stored, min(len(stored), rng.randint(2, 6)))
            store.wait(store.prefetch(ask))
            assert None not in store.lookup(ask)[1], (seed, caps)


def test_a_write_through_prefetch_keeps_an_asked_block_it_finds_in_hbm(tmp_path):
    """Review R31: block 0, hot in HBM, has lost its lower copies (NVMe's victim); making HBM
    room for block 1 dropped it, and the get after the prefetch raised KeyError."""
    tiers = [TierConfig("hbm", 2), TierConfig("dram", 2), TierConfig("nvme", 3)]
    data = torch.randn(4, *LAYOUT.block_shape, generator=torch.Generator().manual_seed(2)).half()
    with TieredKVStore(LAYOUT, tiers, eviction="lru", path=tmp_path, device="cpu", write_through=True) as store:
        store.put([_key(0)], data[0:1])
        store.put([_key(1)], data[1:2])
        store.get([_key(0)])
        store.put([_key(2)], data[2:3])
        store.get([_key(0)])
        store.put([_key(3)], data[3:4])
        assert store.lookup([_key(0), _key(1)])[1] == ["hbm", "nvme"]
        store.wait(store.prefetch([_key(0), _key(1)]))
        assert torch.equal(store.get([_key(0), _key(1)]), data[0:2])


def test_an_asked_block_may_still_move_down_to_make_room_for_another():
    """Review R31: guarding every asked id below the destination kept one waiting in DRAM from
    moving down into NVMe's free slot, so the NVMe run found no room and nothing came up.
    Asked ids are kept (never out of the hierarchy), not frozen in place."""
    from tiercache.core.manager import TierManager
    from tiercache.policies import make_admission, make_eviction

    caps = [4, 1, 9]
    manager = TierManager(list(zip(("hbm", "dram", "nvme"), caps)), [make_eviction("lru", c) for c in caps],
                          [make_admission("always") for _ in caps])
    for block in [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 15, 18, 16, 8, 3, 8, 5, 1, 19, 10]:
        manager.access([block])
    assert 8 in manager.dirs[1].slot_of and manager.dirs[2].n_free == 1
    plans = manager.prefetch([8, 18, 12])
    manager.wait_all()
    assert sum(p.n_blocks for p in plans) == 1 and 18 in manager.dirs[0].slot_of
    assert all(manager.locate(b) is not None for b in (8, 18, 12))
