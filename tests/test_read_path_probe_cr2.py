"""Probe CR2 findings on the live decode read path (each failed before its fix):

* a Ctrl-C (or a failure) in the ``finish`` of a chunk left that chunk's read in flight: the
  next attend reused the window buffer and the abandoned read's late bytes landed in it;
* finite bf16/fp32 V near float32's largest values gave inf or NaN (the float32 weighted sum
  overflowed and only the log-sum-exp triggered the float64 rerun);
* fp16 caches ran the overflow check (a host sync on CUDA) the docstring says they skip.

The Ctrl-C cases are deterministic: the chunk read is held back by a gate, the real SIGINT is
sent to the main thread once it is blocked waiting for that read, and the gate opens only when
the read path drains it (a fixed build) or once the next attend's own read has landed (the old
build, whose abandoned read then overwrites the window under it).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import traceback

import pytest
import torch

import tiercache.attention as attention
from tiercache import TieredKVCache
from tiercache.attention import dense_reference, stream_attention
from tiercache.config import KVLayout, TierConfig
from tiercache.data.nvme_read import NVMeReads
from tiercache.live.chunks import TierChunks

main_thread_only = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                      reason="SIGINT reaches the main thread only")
_WAIT = threading.Condition.wait.__code__


class _HeldRead:
    """Gates NVMe chunk reads: while ``slow``, a read waits for ``gate`` before it reads (and
    sets ``landed`` once it wrote its rows); while ``second``, a read that landed opens the gate
    and waits for the held one to write (the old build's corruption, made deterministic)."""

    def __init__(self, monkeypatch) -> None:
        self.phase = "normal"
        self.entered, self.gate, self.landed = threading.Event(), threading.Event(), threading.Event()
        real = NVMeReads._read_one

        def read_one(store, key, entry, dest, encoded=False):
            if self.phase == "slow":
                self.entered.set()
                self.gate.wait(30)
                try:
                    return real(store, key, entry, dest, encoded)
                finally:
                    self.landed.set()
            result = real(store, key, entry, dest, encoded)
            if self.phase == "second" and not self.gate.is_set():
                self.gate.set()
                self.landed.wait(30)
            return result

        monkeypatch.setattr(NVMeReads, "_read_one", read_one)
        real_settle = TierChunks.settle

        def settle(source, handle):  # the read path drains what it left in flight: let it land
            self.gate.set()
            return real_settle(source, handle)

        monkeypatch.setattr(TierChunks, "settle", settle)


def _ctrl_c_once_waiting(held: _HeldRead, where: str) -> threading.Thread:
    """A thread that sends SIGINT to the main thread once it is blocked in a wait called from
    ``where`` (while the held read has not landed)."""
    main = threading.main_thread().ident

    def send() -> None:
        held.entered.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(main)
            chain = []
            while frame is not None:
                chain.append(frame.f_code)
                frame = frame.f_back
            if chain and chain[0] is _WAIT and any(code.co_name == where for code in chain):
                signal.pthread_kill(main, signal.SIGINT)
                return
            time.sleep(0.005)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _nvme_cache(tmp_path) -> TieredKVCache:
    layout = KVLayout(layers=2, kv_heads=1, head_dim=16, dtype="float32", block_tokens=4)
    tiers = [TierConfig("hbm", 2), TierConfig("dram", 2), TierConfig("nvme", 100)]
    return TieredKVCache(layout, tiers, prefetch="none", path=tmp_path / "nvme", window_blocks=1, depth=1, device="cpu")


def _error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.double() - reference).abs().max())


@main_thread_only
def test_ctrl_c_while_an_attend_waits_for_a_chunk_read_drains_it_before_the_next_attend(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    with _nvme_cache(tmp_path) as cache:
        seq = cache.sequence()
        kv = [(torch.randn(1, 40, 16, generator=gen), torch.randn(1, 40, 16, generator=gen)) for _ in range(2)]
        for layer, (k, v) in enumerate(kv):
            seq.append(layer, k, v)
        q = torch.randn(2, 1, 16, generator=gen)
        reference = dense_reference(q, *kv[1])
        assert _error(seq.attend(1, q), reference) < 1e-5
        held = _HeldRead(monkeypatch)
        held.phase = "slow"
        sender = _ctrl_c_once_waiting(held, "_landed")
        with pytest.raises(KeyboardInterrupt) as interrupted:
            seq.attend(0, q)
        sender.join(30)
        assert any(frame.name == "_landed" for frame in traceback.extract_tb(interrupted.value.__traceback__))
        drained = held.landed.is_set()
        held.phase = "second"
        try:
            after = _error(seq.attend(1, q), reference)
        finally:
            held.phase = "normal"
            held.gate.set()
        assert after < 1e-5, f"error {after}"  # 0.077 before: layer 0's block landed under layer 1's read
        assert drained, "the interrupted attend returned with its chunk read still in flight"
        assert _error(seq.attend(1, q), reference) < 1e-5
        assert _error(seq.attend(0, q), dense_reference(q, *kv[0])) < 1e-5  # the stored KV is intact
        cache.check_invariants()


@main_thread_only
def test_ctrl_c_while_a_chunk_read_is_submitted_waits_for_it_before_raising(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    with _nvme_cache(tmp_path) as cache:
        seq = cache.sequence()
        seq.append(0, torch.randn(1, 40, 16, generator=gen), torch.randn(1, 40, 16, generator=gen))
        source = seq.stream_source(0)  # outside any call: no deferral around start
        tier = len(cache.store._media) - 1
        nvme = cache.store._media[tier]
        index = next(i for i, chunk in enumerate(source.chunks) if chunk.pieces[0].tier == tier)
        held = _HeldRead(monkeypatch)
        held.phase = "slow"
        real_submit = nvme.submit_get

        def submit_then_ctrl_c(keys, out):
            future = real_submit(keys, out)
            held.entered.wait(30)
            signal.raise_signal(signal.SIGINT)
            return future

        monkeypatch.setattr(nvme, "submit_get", submit_then_ctrl_c)
        try:
            with pytest.raises(KeyboardInterrupt):
                source.start(index, 0)
            assert held.landed.is_set(), "start raised with a read it had started still writing the window"
        finally:
            held.gate.set()
            held.landed.wait(30)


class _FailingFinish:
    """A ChunkSource whose chunk 0 fails in ``finish`` (its other pieces may still be landing)."""

    def __init__(self) -> None:
        self.k, self.v = torch.randn(1, 12, 4), torch.randn(1, 12, 4)
        self.settled: list[int] = []

    def start(self, index, buffer):
        return index

    def finish(self, index):
        if index == 0:
            raise OSError("EIO reading chunk 0")
        return self.k[:, 4 * index : 4 * index + 4], self.v[:, 4 * index : 4 * index + 4]

    def settle(self, index):
        self.settled.append(index)


def test_a_chunk_whose_finish_fails_is_drained_with_the_rest():
    source = _FailingFinish()
    with pytest.raises(OSError, match="EIO reading chunk 0"):
        stream_attention(torch.randn(1, 1, 4), 1, source, 3, depth=2)
    assert source.settled == [0, 1]  # the one being finished included (only [1] before)


def _cache(dtype: str, window_blocks: int) -> TieredKVCache:
    layout = KVLayout(layers=1, kv_heads=1, head_dim=8, dtype=dtype, block_tokens=4)
    return TieredKVCache(layout, [TierConfig("hbm", 8), TierConfig("dram", 8)], prefetch="none",
                         window_blocks=window_blocks, device="cpu")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", ["all_large", "opposite_blocks"])
def test_finite_values_near_float32_max_give_the_float64_reference(dtype, case):
    td = getattr(torch, dtype)
    with _cache(dtype, window_blocks=1 if case == "opposite_blocks" else 2) as cache:
        seq = cache.sequence()
        k = torch.zeros(1, 18, 8, dtype=td)  # equal scores: every value weighs the same
        if case == "all_large":
            v = torch.full((1, 18, 8), 3e38).to(td)  # inf before (the float32 sum of weighted values)
        else:
            v = torch.cat([torch.full((1, 8, 8), 3e38), torch.full((1, 8, 8), -3e38), torch.zeros(1, 2, 8)], 1).to(td)
        seq.append(0, k, v)
        q = torch.ones(1, 1, 8, dtype=td)
        reference, largest = dense_reference(q, k, v), float(v.double().abs().max())
        out = seq.attend(0, q)
        assert torch.isfinite(out).all()  # inf or NaN before (inf - inf in a merge)
        assert _error(out, reference) <= 1e-6 * largest
        part = seq.attend_partial(0, q)
        assert torch.isfinite(part.out).all() and torch.isfinite(part.lse).all()
        assert _error(part.out.reshape(q.shape), reference) <= 1e-6 * largest


def test_an_fp16_cache_skips_the_overflow_check_and_a_bf16_one_runs_it(monkeypatch):
    seen: list[bool] = []
    real = attention.may_overflow

    def spy(*inputs):
        seen.append(real(*inputs))
        return seen[-1]

    monkeypatch.setattr(attention, "may_overflow", spy)
    gen = torch.Generator().manual_seed(2)
    k, v, q = torch.randn(1, 10, 8, generator=gen), torch.randn(1, 10, 8, generator=gen), torch.randn(1, 1, 8, generator=gen)
    for dtype, checked in ((torch.float16, False), (torch.bfloat16, True)):
        seen.clear()
        with _cache(str(dtype).split(".")[1], window_blocks=1) as cache:
            seq = cache.sequence()
            seq.append(0, k.to(dtype), v.to(dtype))
            out = seq.attend(0, q.to(dtype))
        assert seen and any(seen) is checked  # fp16: True before (it judged the float32 copies)
        reference = dense_reference(q.to(dtype), k.to(dtype), v.to(dtype))
        assert float((out.double() - reference).abs().max()) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_passes_own_causal_part_and_its_merge_stay_finite_for_v_near_the_max(dtype):
    """The transformers cache's causal part of a pass (fused and sliced paths) and its merge with
    the held part overflowed to inf for finite V near float32's max (reported with CR2)."""
    from tiercache.attention import Partial, merge
    from tiercache.integrations.causal import causal_partial

    q, k = torch.zeros(4, 5, 8, dtype=dtype), torch.zeros(2, 5, 8, dtype=dtype)
    v = torch.full((2, 5, 8), 3e38, dtype=dtype)
    for key_pos in (None, torch.arange(5)):  # fused, then sliced
        part = causal_partial(q, k, v, torch.float32, key_pos)
        assert torch.isfinite(part.out).all()
        assert torch.allclose(part.out.double(), v.double().amax().expand_as(part.out), rtol=1e-2)
    held = Partial(torch.full((1, 1, 4), 3e38), torch.zeros(1, 1), torch.ones(1, 1))
    assert torch.isfinite(merge(held, held).out).all()
