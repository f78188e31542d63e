"""BlockPool: preallocated HBM/DRAM block pools, slot copies, validation, pinning fallback."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tiercache.config import KVLayout
from tiercache.data import pools
from tiercache.data.buffers import PAGE, torch_dtype
from tiercache.data.pools import BlockPool, copy_runs, dram_pool, hbm_pool
from tiercache.errors import UserError

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16", per_layer=True)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def random_blocks(layout: KVLayout, n: int, seed: int = 0) -> torch.Tensor:
    """Blocks of random bit patterns (NaNs and infinities included), compared bitwise."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (n, *layout.block_shape), dtype=torch.int16, generator=g)
    return bits.view(torch_dtype(layout.dtype)) if layout.dtype_bytes == 2 else bits.to(torch_dtype(layout.dtype))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)


def test_pool_is_preallocated_with_layout_shape_and_dtype():
    pool = BlockPool(LAYOUT, 8)
    assert pool.tensor.shape == (8, *LAYOUT.block_shape)
    assert pool.tensor.dtype == torch.bfloat16
    assert pool.tensor.data_ptr() % PAGE == 0, "host pools are page aligned so O_DIRECT can land in a slot"
    assert pool.block_bytes == LAYOUT.block_bytes


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_write_read_round_trip_is_bit_identical(dtype):
    layout = KVLayout(2, 2, 64, dtype=dtype, block_tokens=16, per_layer=True)
    pool = BlockPool(layout, 16)
    blocks = random_blocks(layout, 5, seed=1)
    slots = [9, 2, 15, 3, 4]
    pool.write(slots, blocks)
    assert torch.equal(bits(pool.read(slots)), bits(blocks))
    for i, slot in enumerate(slots):
        assert torch.equal(bits(pool.view(slot)), bits(blocks[i]))


def test_read_into_preallocated_out_reuses_it():
    pool = BlockPool(LAYOUT, 8)
    pool.write(np.arange(8), random_blocks(LAYOUT, 8))
    out = torch.empty((3, *LAYOUT.block_shape), dtype=torch.bfloat16)
    ptr = out.data_ptr()
    result = pool.read(np.array([7, 0, 4]), out=out)
    assert result is out and out.data_ptr() == ptr
    assert torch.equal(bits(out), bits(pool.tensor[[7, 0, 4]]))


def test_view_is_a_view_not_a_copy():
    pool = BlockPool(LAYOUT, 4)
    pool.view(2).fill_(1.5)
    assert bool((pool.tensor[2] == 1.5).all())
    assert pool.view(2).data_ptr() == pool.tensor[2].data_ptr()


@pytest.mark.parametrize("n", [6, 600])  # 600 blocks x 16 KiB exercises the threaded host copy
def test_copy_to_random_slots_moves_exactly_those_blocks(n):
    src, dst = dram_pool(LAYOUT, n), hbm_pool(LAYOUT, n)
    src.write(np.arange(n), random_blocks(LAYOUT, n, seed=2))
    rng = np.random.default_rng(3)
    src_slots, dst_slots = rng.permutation(n)[: n // 2], rng.permutation(n)[: n // 2]
    before = bits(dst.tensor).clone()
    src.copy_to(dst, src_slots, dst_slots)
    assert torch.equal(bits(dst.tensor[dst_slots]), bits(src.tensor[src_slots]))
    untouched = np.setdiff1d(np.arange(n), dst_slots)
    assert torch.equal(bits(dst.tensor[untouched]), before[untouched])


def test_copy_to_contiguous_runs_and_back():
    a, b = BlockPool(LAYOUT, 10), BlockPool(LAYOUT, 10)
    a.write(np.arange(10), random_blocks(LAYOUT, 10, seed=4))
    a.copy_to(b, [0, 1, 2, 3], [5, 6, 7, 8])
    b.copy_to(a, [5, 6], [9, 8])
    assert torch.equal(bits(a.tensor[9]), bits(a.tensor[0]))
    assert torch.equal(bits(a.tensor[8]), bits(a.tensor[1]))


def test_copy_runs_coalesces_consecutive_slots():
    assert copy_runs(np.array([0, 1, 2, 7, 8]), np.array([4, 5, 6, 1, 2])) == [(0, 4, 3), (7, 1, 2)]
    assert copy_runs(np.array([3, 4]), np.array([0, 9])) == [(3, 0, 1), (4, 9, 1)]
    assert copy_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []


def test_wrong_dtype_names_expected_and_got():
    pool = BlockPool(LAYOUT, 4)
    with pytest.raises(UserError, match="expected dtype bfloat16, got float16"):
        pool.write([0], torch.zeros((1, *LAYOUT.block_shape), dtype=torch.float16))


def test_wrong_shape_names_expected_and_got():
    pool = BlockPool(LAYOUT, 4)
    with pytest.raises(UserError, match=r"expected shape \[2, 1, 2, 2, 16, 64\], got \[2, 1, 2, 2, 16, 32\]"):
        pool.write([0, 1], torch.zeros((2, 1, 2, 2, 16, 32), dtype=torch.bfloat16))
    with pytest.raises(UserError, match="expected shape"):
        pool.read([0, 1], out=torch.zeros((1, *LAYOUT.block_shape), dtype=torch.bfloat16))


def test_bad_slots_and_capacity_raise_user_errors():
    pool = BlockPool(LAYOUT, 4)
    with pytest.raises(UserError, match=r"slots must lie in \[0, 4\)"):
        pool.read([4])
    with pytest.raises(UserError, match="integer slots"):
        pool.read([0.5])
    with pytest.raises(UserError, match="capacity must be at least one block"):
        BlockPool(LAYOUT, 0)
    with pytest.raises(UserError, match=r"capacity must be an integer number of blocks, got 1.5 \(float\)"):
        BlockPool(LAYOUT, 1.5)
    with pytest.raises(UserError, match="2 source slots but 1 destination"):
        pool.copy_to(BlockPool(LAYOUT, 4), [0, 1], [0])
    with pytest.raises(UserError, match="layouts differ"):
        pool.copy_to(BlockPool(KVLayout(2, 2, 32, block_tokens=16, per_layer=True), 4), [0], [0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works with CUDA")
def test_dram_pool_falls_back_to_ordinary_memory_and_says_so_once(caplog, monkeypatch):
    monkeypatch.setattr(pools, "_pin_fallback_logged", False)
    with caplog.at_level(logging.INFO, logger="tiercache.data.pools"):
        first, second = dram_pool(LAYOUT, 2), dram_pool(LAYOUT, 2)
    assert not first.pinned and not second.pinned
    assert sum("pinned host memory unavailable" in r.message for r in caplog.records) == 1
    assert hbm_pool(LAYOUT, 2).device.type == "cpu"


@pytest.mark.gpu
@cuda
def test_pinned_dram_to_hbm_copies_match_on_cuda():
    dram, hbm = dram_pool(LAYOUT, 64), hbm_pool(LAYOUT, 64)
    assert dram.pinned and hbm.device.type == "cuda"
    dram.write(np.arange(64), random_blocks(LAYOUT, 64, seed=5))
    rng = np.random.default_rng(6)
    src, dst = rng.permutation(64), rng.permutation(64)
    dram.copy_to(hbm, src, dst, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(bits(hbm.tensor[dst].cpu()), bits(dram.tensor[src]))
    back = torch.empty((64, *LAYOUT.block_shape), dtype=torch.bfloat16).pin_memory()
    hbm.read(dst, out=back, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(bits(back), bits(dram.tensor[src]))


@pytest.mark.parametrize("n", [1, 7])
def test_a_pool_with_header_room_copies_like_a_plain_one_and_keeps_slots_page_aligned(n):
    """Header room (kept before each slot above a remote tier) changes the slot pitch, not
    what any copy does: every path between padded and plain pools moves exactly the blocks
    named; slots stay page aligned; ``header`` is the 64 bytes right before a slot, and
    writing it leaves every block as it was."""
    padded = BlockPool(LAYOUT, 9, "cpu", header_room=pools.HEADER_ROOM)
    plain = BlockPool(LAYOUT, 9, "cpu")
    data = random_blocks(LAYOUT, n, seed=n)
    rng = np.random.default_rng(n)
    src, dst = rng.choice(9, n, replace=False), rng.choice(9, n, replace=False)
    padded.write(src, data)
    assert torch.equal(bits(padded.read(src)), bits(data))
    padded.copy_to(plain, src, dst)
    assert torch.equal(bits(plain.read(dst)), bits(data))
    plain.copy_to(padded, dst, np.arange(n))  # a run of adjacent slots on the padded side
    assert torch.equal(bits(padded.tensor[:n]), bits(data))
    assert all(padded.view(s).data_ptr() % PAGE == 0 for s in range(9))
    for s in range(9):
        header = padded.header(s)
        assert header.nbytes == pools.HEADER_BYTES and header.ctypes.data + pools.HEADER_BYTES == padded.view(s).data_ptr()
        header[:] = 0xEE
    assert torch.equal(bits(padded.tensor[:n]), bits(data))
    with pytest.raises(UserError, match="no header room"):
        plain.header(0)


def _slots_contiguous_reference(tensor: torch.Tensor) -> bool:
    """The definition: each slot a contiguous tensor, and slots no closer than a slot's bytes."""
    return tensor.shape[0] == 0 or (tensor[0].is_contiguous()
                                    and tensor.stride(0) * tensor.element_size() >= tensor[0].numel() * tensor.element_size())


@pytest.mark.parametrize("seed", range(3))
def test_slot_contiguity_from_strides_matches_the_definition(seed):
    """``_slots_contiguous`` reads shape and strides (no view per copy); checked against
    torch's own ``is_contiguous`` of a slot on views of every kind."""
    rng, outcomes = np.random.default_rng(seed), set()
    for _ in range(300):
        shape = [int(x) for x in rng.integers(0, 4, size=int(rng.integers(2, 5)))]
        base = torch.zeros(*[max(s, 1) * 2 for s in shape])
        view = base[tuple(slice(0, s, int(rng.integers(1, 3))) for s in shape)]
        if rng.random() < 0.3:
            dims = list(range(1, view.dim()))
            rng.shuffle(dims)
            view = view.permute(0, *dims)
        if rng.random() < 0.2 and view.dim() > 1 and view.shape[1] == 1:
            view = view.expand(view.shape[0], 3, *view.shape[2:])
        want = _slots_contiguous_reference(view)
        assert pools._slots_contiguous(view) == want, (tuple(view.shape), view.stride())
        outcomes.add(want)
    assert outcomes == {True, False}


def test_one_slot_copies_take_the_short_path_and_still_check_bounds():
    assert copy_runs(np.array([7]), np.array([3])) == [(7, 3, 1)]
    pool = BlockPool(LAYOUT, 4)
    block = torch.randn(1, *LAYOUT.block_shape).to(torch.bfloat16)
    pool.write([3], block)
    assert torch.equal(pool.read([3]), block)
    for bad in ([4], [-1], np.array([9])):
        with pytest.raises(UserError, match=r"slots must lie in \[0, 4\), got min"):
            pool.write(bad, block)


def test_runs_between_a_pool_with_header_room_and_a_packed_one_copy_slot_by_slot(monkeypatch):
    """Review Q64: a run of slots with header room between them is no contiguous span, and
    torch copies such a host side to the GPU synchronously; each slot is copied alone (its
    own span), and what lands is the same."""
    from tiercache.data.pools import _copy_runs

    roomy = torch.zeros(6, 4096 + 64, dtype=torch.uint8)[:, 4096:]  # slots of 64 bytes, 4 KiB apart
    packed = torch.arange(6 * 64, dtype=torch.int64).to(torch.uint8).reshape(6, 64)
    shapes = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, other, **kw: shapes.append(tuple(self.shape)) or
                        real_copy(self, other, **kw))
    _copy_runs(roomy, packed, [(0, 1, 3), (4, 5, 1)], non_blocking=False)
    assert shapes == [(64,), (64,), (64,), (1, 64)]  # the run of 3 slot by slot; contiguous each
    assert torch.equal(roomy[1:4], packed[0:3]) and torch.equal(roomy[5], packed[4])
    shapes.clear()
    _copy_runs(packed, packed.clone(), [(0, 2, 3)], non_blocking=False)
    assert shapes == [(3, 64)]  # packed on both sides: one copy of the run
