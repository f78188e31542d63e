"""Probe Q64 findings on the GPU path, checked here with CUDA faked where no device exists.

* ``resolve_device`` returned ``cuda`` without an index, and a quantised HBM tier kept it as
  its device: tensors on the GPU report ``cuda:0``, and ``cuda != cuda:0`` in torch, so every
  ``Sequence.append`` on such a cache was refused.
* Pinned pools came from torch's pinned allocator, which rounds each allocation up to a power
  of two (a 40 GiB DRAM tier locked 64 GiB) and caches freed blocks: they are now an mmap of
  their own size registered with ``cudaHostRegister``, unregistered when the pool goes.
* ``get(out=...)`` never checked ``out``'s device: a host ``out`` for a GPU store got past the
  checks and failed in torch after blocks had been promoted.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from store_helpers import LAYOUT, blocks, key, tiers
from tiercache.config import KVLayout
from tiercache.data import pools
from tiercache.data.buffers import PAGE, round_up
from tiercache.errors import UserError
from tiercache.live.media import resolve_device
from tiercache.live.store import TieredKVStore

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
POOL_LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16", per_layer=True)


def test_cuda_without_an_index_resolves_to_the_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device(None) == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")


class FakeCudart:
    """Records ``cudaHostRegister``/``cudaHostUnregister`` calls; answers ``error``."""

    def __init__(self, error: int = 0) -> None:
        self.error, self.calls = error, []

    def cudaHostRegister(self, pointer, size, flags):  # noqa: N802 - CUDA's name
        self.calls.append(("register", pointer, size, flags))
        return self.error

    def cudaHostUnregister(self, pointer):  # noqa: N802
        self.calls.append(("unregister", pointer))
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    cudart = FakeCudart()
    cudart.capturing = False
    monkeypatch.setattr(pools, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: cudart.calls.append(("synchronize", device)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: cudart.capturing)
    return cudart


def test_a_pinned_pool_registers_exactly_its_pages_and_unregisters_when_dropped(fake_cuda):
    capacity = 5  # 5 x 8 KiB: torch's pinned allocator would have locked 64 KiB
    pool = pools.dram_pool(POOL_LAYOUT, capacity)
    assert pool.pinned
    pointer = pool.host_buffer.data_ptr()
    expected = round_up(capacity * POOL_LAYOUT.block_bytes)
    assert expected % PAGE == 0 and expected < 2 ** (expected - 1).bit_length()  # not a power of two here
    assert fake_cuda.calls == [("register", pointer, expected, 1)]
    data = torch.randn(2, *POOL_LAYOUT.block_shape).to(torch.bfloat16)
    pool.write([0, 3], data)
    assert torch.equal(pool.read([0, 3]), data)
    del pool
    gc.collect()
    # after every device's copies (a store's copy streams may be on cuda:1)
    assert fake_cuda.calls[1:] == [("synchronize", 0), ("synchronize", 1), ("unregister", pointer)]


def test_a_pool_dropped_during_a_graph_capture_is_unregistered_after_it(fake_cuda):
    """Review R35: a synchronise inside a CUDA graph capture breaks the capture."""
    fake_cuda.capturing = True
    pool = pools.dram_pool(POOL_LAYOUT, 2)
    pointer = pool.host_buffer.data_ptr()
    del pool
    gc.collect()
    assert [c[0] for c in fake_cuda.calls] == ["register"]  # nothing synchronised or unregistered yet
    fake_cuda.capturing = False
    later = pools.dram_pool(POOL_LAYOUT, 2)  # the next registration ends the deferred one first
    assert fake_cuda.calls[1:4] == [("synchronize", 0), ("synchronize", 1), ("unregister", pointer)]
    assert fake_cuda.calls[4][0] == "register" and later.pinned


def test_a_cuda_that_cannot_start_leaves_ordinary_memory(fake_cuda, monkeypatch, caplog):
    """Review R35: torch's pinned allocator's RuntimeError fell back to ordinary memory; the
    registration must too (a forked child of a CUDA process, a broken driver)."""
    def broken():
        raise RuntimeError("CUDA error: initialization error\nmore")

    monkeypatch.setattr(torch.cuda, "cudart", broken)
    with caplog.at_level(logging.WARNING, logger="tiercache.data.pinning"):
        pool = pools.dram_pool(POOL_LAYOUT, 2)
    assert not pool.pinned
    assert any("pinning a pool's host memory failed (CUDA error: initialization error)" in r.message for r in caplog.records)


def test_a_failed_registration_leaves_a_working_ordinary_pool_and_says_so(fake_cuda, caplog):
    fake_cuda.error = 2  # cudaErrorMemoryAllocation
    with caplog.at_level(logging.WARNING, logger="tiercache.data.pinning"):
        pool = pools.dram_pool(POOL_LAYOUT, 3)
    assert not pool.pinned
    assert any("cudaHostRegister of" in r.message and "cudaError 2" in r.message for r in caplog.records)
    block = torch.randn(1, *POOL_LAYOUT.block_shape).to(torch.bfloat16)
    pool.write([2], block)
    assert torch.equal(pool.read([2]), block)
    del pool
    gc.collect()
    assert [c[0] for c in fake_cuda.calls] == ["register"]  # nothing registered, nothing to unregister


def test_an_out_on_another_device_is_refused_before_anything_is_read(tmp_path, monkeypatch):
    data = blocks(4, 1)
    keys = [key(i) for i in range(4)]
    with TieredKVStore(LAYOUT, tiers(hbm=2, dram=2, nvme=8), path=tmp_path / "nvme", device="cpu") as store:
        store.put(keys, data)
        before = store.stats()
        monkeypatch.setattr(type(store), "hbm_device", property(lambda self: torch.device("cuda", 0)))
        out = torch.empty(2, *LAYOUT.block_shape, dtype=data.dtype)
        with pytest.raises(UserError, match=r"TieredKVStore\.get out: on cpu, but this store returns blocks on .* cuda:0"):
            store.get(keys[:2], out=out)
        with pytest.raises(UserError, match=r"get_prefix out: on cpu"):
            store.get_prefix(keys[:2], out=out)
        monkeypatch.undo()
        assert store.stats() == before  # refused before anything was looked up, moved or counted
        assert torch.equal(store.get(keys, out=torch.empty_like(data)), data)


@pytest.mark.gpu
@cuda
def test_a_cache_with_a_quantised_hbm_tier_takes_tensors_on_the_gpu():
    from tiercache.config import TierConfig
    from tiercache.live.cache import TieredKVCache

    layout = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
    tiers_ = (TierConfig("hbm", 8, codec="int8"), TierConfig("dram", 16))
    with TieredKVCache(layout, tiers_) as cache:
        assert cache.device == torch.device("cuda", torch.cuda.current_device())
        seq = cache.sequence(tokens=list(range(40)))
        kv = torch.randn(2, 40, 64, device="cuda").half()
        for layer in range(layout.layers):
            seq.append(layer, kv, kv)  # refused before: "must be on cuda, got cuda:0"
        out = seq.attend(0, torch.randn(4, 1, 64, device="cuda").half())
        assert out.device == cache.device and torch.isfinite(out).all()


@pytest.mark.gpu
@cuda
def test_a_registered_pool_is_pinned_and_round_trips_asynchronously():
    dram, hbm = pools.dram_pool(POOL_LAYOUT, 6), pools.hbm_pool(POOL_LAYOUT, 6)
    assert dram.pinned and dram.host_buffer.is_pinned()
    data = torch.randn(6, *POOL_LAYOUT.block_shape).to(torch.bfloat16)
    dram.write(range(6), data)
    dram.copy_to(hbm, [0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], non_blocking=True)
    back = pools.dram_pool(POOL_LAYOUT, 6)
    hbm.copy_to(back, list(range(6)), list(range(6)), non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back.read(range(6)), data.flip(0))
