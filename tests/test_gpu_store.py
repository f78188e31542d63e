"""CUDA paths of the live store: HBM on the GPU, copy stream + events, staging to NVMe.

Marked ``gpu``: skipped without CUDA; ``scripts/device_check.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from tiercache.config import KVLayout, TierConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LAYOUT = KVLayout(layers=4, kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=16)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_gpu_round_trip_through_every_tier(tmp_path):
    from tiercache.live.store import TieredKVStore

    data = torch.randn((24, *LAYOUT.block_shape), dtype=torch.bfloat16, device="cuda")
    tiers = [TierConfig("hbm", 4), TierConfig("dram", 6), TierConfig("nvme", 64)]
    with TieredKVStore(LAYOUT, tiers, path=tmp_path / "nvme") as store:
        assert store.engine.cuda  # the CUDA engine, not the CPU fallback
        store.put([_key(i) for i in range(24)], data)
        assert set(store.lookup([_key(i) for i in range(24)])[1]) == {"hbm", "dram", "nvme"}
        for i in range(24):
            got = store.get([_key(i)])
            assert got.device.type == "cuda" and torch.equal(got[0], data[i]), i
        store.check_invariants()


def test_gpu_pool_copy_matches_host_copy():
    from tiercache.data.pools import BlockPool

    host = BlockPool(LAYOUT, 8, "cpu", pin_memory=True)
    device = BlockPool(LAYOUT, 8, "cuda")
    source = torch.randn((8, *LAYOUT.block_shape)).to(torch.bfloat16)
    host.write(list(range(8)), source)
    host.copy_to(device, [7, 0, 1, 2], [0, 1, 2, 3], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(device.read([0, 1, 2, 3]).cpu(), source[[7, 0, 1, 2]])
