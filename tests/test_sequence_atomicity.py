"""The decode API's calls are all or nothing: a call that raises part-way, an interrupt or an
I/O fault alike, leaves the sequence and the cache as they were (attention still equals the
float64 dense reference over what was appended, no hold is left behind). Each case came from
an adversarial probe and failed before its fix.
"""

from __future__ import annotations

import pytest
import torch

from tiercache import AttentionMode, TieredKVCache
from tiercache.attention import dense_reference
from tiercache.config import KVLayout, TierConfig
from tiercache.live import chunks


def small_cache(tmp_path, **options) -> TieredKVCache:
    """One-KV-head float32 layers of 4-token blocks over tiny HBM and DRAM tiers and NVMe."""
    layout = KVLayout(layers=options.pop("layers", 1), kv_heads=1, head_dim=8, dtype="float32", block_tokens=4)
    tiers = [TierConfig("hbm", options.pop("hbm", 3)), TierConfig("dram", 3), TierConfig("nvme", 64)]
    return TieredKVCache(layout, tiers, path=tmp_path / "nvme", device="cpu", **options)


class Appended:
    """Random KV appended to a sequence, kept for the dense reference."""

    def __init__(self, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.k: dict[int, list[torch.Tensor]] = {}
        self.v: dict[int, list[torch.Tensor]] = {}

    def kv(self, layer: int, tokens: int, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = torch.randn(1, tokens, 8, generator=self.gen), torch.randn(1, tokens, 8, generator=self.gen)
        if keep:
            self.k.setdefault(layer, []).append(k)
            self.v.setdefault(layer, []).append(v)
        return k, v

    def error(self, seq, layer: int) -> float:
        q = torch.randn(2, 1, 8, generator=self.gen)
        want = dense_reference(q, torch.cat(self.k[layer], 1), torch.cat(self.v[layer], 1))
        return float((seq.attend(layer, q).double() - want).abs().max())


@pytest.mark.parametrize("step", ["_emit", "_settle_events"])
def test_an_append_interrupted_after_its_store_appends_nothing(tmp_path, monkeypatch, step):
    kv = Appended()
    with small_cache(tmp_path) as cache:
        seq = cache.sequence()
        seq.append(0, *kv.kv(0, 6))  # one block and a 2-token tail
        k, v = kv.kv(0, 3, keep=False)

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(cache, step, interrupted)
        with pytest.raises(KeyboardInterrupt):
            seq.append(0, k, v)  # fills a block: stores, then is interrupted
        monkeypatch.undo()
        assert seq.length(0) == 6
        seq.append(0, k, v)  # the caller retries
        kv.k[0].append(k)
        kv.v[0].append(v)
        assert seq.length(0) == 9 and kv.error(seq, 0) < 1e-5
        seq.free()
        assert not any(cache.manager.held.values())
        cache.check_invariants()


def test_an_interrupted_free_is_finished_by_the_next(tmp_path, monkeypatch):
    kv = Appended(1)
    with small_cache(tmp_path) as cache:
        seq = cache.sequence()
        seq.append(0, *kv.kv(0, 16))
        real = cache.driver.release

        def interrupted(ids):
            raise KeyboardInterrupt

        monkeypatch.setattr(cache.driver, "release", interrupted)
        with pytest.raises(KeyboardInterrupt):
            seq.free()
        monkeypatch.setattr(cache.driver, "release", real)
        seq.free()
        assert not any(cache.manager.held.values())


def test_a_prefix_reuse_interrupted_after_its_holds_leaves_none(tmp_path, monkeypatch):
    kv = Appended(2)
    with small_cache(tmp_path) as cache:
        tokens = list(range(40))
        first = cache.sequence(tokens=tokens)
        first.append(0, *kv.kv(0, 40))
        first.free()

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(cache, "_emit", interrupted)
        with pytest.raises(KeyboardInterrupt):
            cache.sequence(tokens=tokens)  # holds the stored prefix, then is interrupted
        monkeypatch.undo()
        assert not any(cache.manager.held.values())
        again = cache.sequence(tokens=tokens)
        assert again.cached_tokens == 36
        again.free()


def test_reads_left_in_flight_by_a_failed_step_land_before_the_next_step_reads(tmp_path, monkeypatch):
    """A step that fails while later chunks are still being read must wait for them: a read
    landing late in the shared window would overwrite the next step's chunk."""
    kv = Appended(3)
    with small_cache(tmp_path, layers=2, hbm=1, window_blocks=2, depth=2, prefetch="none") as cache:
        seq = cache.sequence()
        for layer in range(2):
            seq.append(layer, *kv.kv(layer, 32))  # 8 blocks per layer, most on NVMe
        settled = []
        real_settle = chunks.TierChunks.settle

        def recording_settle(self, handle):
            real_settle(self, handle)
            settled.append(handle[2] is None or handle[2][0].done())

        def failing_finish(self, handle):
            raise KeyboardInterrupt

        monkeypatch.setattr(chunks.TierChunks, "settle", recording_settle)
        monkeypatch.setattr(chunks.TierChunks, "finish", failing_finish)
        with pytest.raises(KeyboardInterrupt):
            seq.attend(0, torch.randn(2, 1, 8))
        monkeypatch.undo()
        assert settled and all(settled)  # every fetch in flight was waited for
        assert kv.error(seq, 1) < 1e-5 and kv.error(seq, 0) < 1e-5


def test_a_sparse_read_of_a_lost_block_names_it(tmp_path):
    kv = Appended(4)
    with small_cache(tmp_path, hbm=2) as cache:
        seq = cache.sequence()
        seq.append(0, *kv.kv(0, 40))
        lost = next(int(b) for b in seq._layers[0].ids[: seq.blocks(0)] if cache.manager.locate(int(b)) == 2)
        cache.manager.report_lost(2, [lost])
        cache._settle_events()
        with pytest.raises(RuntimeError, match="no longer stored"):
            seq.attend(0, torch.randn(2, 1, 8), AttentionMode.SPARSE, budget=10)


def test_a_corrupt_chunk_met_during_prefix_reuse_is_reported_lost_and_reuse_stops_before_it(tmp_path):
    kv = Appended(5)
    tokens = list(range(40))
    with small_cache(tmp_path, layers=2) as cache:
        first = cache.sequence(tokens=tokens)
        for layer in range(2):
            first.append(layer, *kv.kv(layer, 40))
        first.free()
        cache.close(persist=True)  # reopened, no block keeps its summary: reuse reads them
    with small_cache(tmp_path, layers=2) as cache:
        assert cache.match_prefix(tokens) == 40
        nvme = cache.store._media[2]
        with open(nvme.chunk_path(0), "r+b") as chunk:
            chunk.seek(10)
            chunk.write(b"\xff\xfe\xfd")
        again = cache.sequence(tokens=tokens)  # no KeyError: the corrupt block is reported lost
        assert again.cached_tokens < 36
        assert cache.match_prefix(tokens) == again.cached_tokens
        assert sum(tier["lost"] for tier in cache.stats()["tiers"]) == 1
        again.free()
        cache.check_invariants()


def test_corrupt_chunks_of_a_read_that_also_met_an_io_error_are_reported_lost_at_once(tmp_path, monkeypatch):
    from tiercache.data.nvme_results import ReadIOError

    kv = Appended(6)
    with small_cache(tmp_path, hbm=2) as cache:
        seq = cache.sequence()
        seq.append(0, *kv.kv(0, 40))
        nvme = cache.store._media[2]
        keys = [key for key in seq._layers[0].keys if nvme.contains(key)]
        with open(nvme.chunk_path(nvme.slot_of(keys[0])), "r+b") as chunk:
            chunk.seek(10)
            chunk.write(b"\xff\xfe\xfd")
        failing = nvme.slot_of(keys[1])
        real = type(nvme)._read_verified

        def io_error(self, entry, dest):
            if entry.slot == failing:
                raise OSError(5, "Input/output error")
            return real(self, entry, dest)

        monkeypatch.setattr(type(nvme), "_read_verified", io_error)
        with pytest.raises(ReadIOError):
            seq.attend(0, torch.randn(2, 1, 8))
        monkeypatch.undo()
        cache.check_invariants()  # the corrupt block is no longer listed as stored
        assert sum(tier["lost"] for tier in cache.stats()["tiers"]) == 1
