"""Probe q12 (raw per-layer decode API): ``check_invariants`` holds the store's lock for its
cache-level part too; a refused ``attend`` takes no step number; sparse-layout KV and queries
are refused naming the argument; ``stream_source`` refuses a freed sequence and a closed
cache; ``attend_partial``'s errors name ``attend_partial``."""

from __future__ import annotations

import threading

import pytest
import torch

import tiercache.live.sequence as sequence_module
from tiercache import AttentionMode, TieredKVCache
from tiercache.config import KVLayout, TierConfig
from tiercache.errors import UserError

LAYOUT = KVLayout(layers=1, kv_heads=2, head_dim=8, dtype="float32", block_tokens=4)


def _cache(hbm: int = 8, dram: int = 0, **options) -> TieredKVCache:
    tiers = [TierConfig("hbm", hbm)] + ([TierConfig("dram", dram)] if dram else [])
    return TieredKVCache(LAYOUT, tiers, device="cpu", **options)


def _kv(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, tokens, 8), torch.randn(2, tokens, 8)


# ----- F1: check_invariants is one call under the store's lock ----------------------------


def test_check_invariants_keeps_other_threads_out_of_its_cache_level_part(monkeypatch):
    """While the cache-level part counts holds, a second thread that would free a sequence
    whenever the lock is free (an unserialised worker) must find it taken; before the fix it
    freed the sequence mid-check and the check failed falsely ("list it 0 times, 1 holds")."""
    with _cache() as cache:
        seq = cache.sequence()
        seq.append(0, *_kv(12))  # three held blocks
        real_hold_count = cache.manager.hold_count
        lock_free_seen: list[bool] = []

        def worker() -> None:
            with cache.store._lock.if_free() as free:
                lock_free_seen.append(free)
                if free:
                    seq.free()

        def hold_count(block_id: int) -> int:
            count = real_hold_count(block_id)
            if not lock_free_seen:  # once, after the first block's holds were counted
                thread = threading.Thread(target=worker)
                thread.start()
                thread.join()  # never blocks: ``if_free`` does not wait
            return count

        monkeypatch.setattr(cache.manager, "hold_count", hold_count)
        cache.check_invariants()
        assert lock_free_seen == [False]
        assert not seq.freed and seq.blocks(0) == 3
        monkeypatch.undo()
        seq.free()
        cache.check_invariants()


def test_check_invariants_on_a_closed_cache_names_the_cache():
    cache = _cache()
    cache.close()
    with pytest.raises(UserError, match=r"^TieredKVCache: the cache is closed$"):
        cache.check_invariants()


# ----- F2: a refused attend takes no step number -----------------------------------------


def test_refused_attends_do_not_advance_the_step_counter():
    with _cache() as cache:
        seq = cache.sequence()
        seq.append(0, *_kv(20))
        q = torch.randn(4, 1, 8)
        seq.attend(0, q)
        refusals = [
            (dict(budget=3), r"^Sequence\.attend: budget applies to AttentionMode\.SPARSE only$"),
            (dict(mode=AttentionMode.SPARSE), r"^Sequence\.attend: AttentionMode\.SPARSE needs a budget"),
            (dict(mode=AttentionMode.SPARSE, budget=0), r"^Sequence\.attend: a budget count must be at least one block, got 0$"),
            (dict(mode=AttentionMode.SPARSE, budget=1.5), r"^Sequence\.attend: a budget share must lie in \(0, 1\], got 1\.5$"),
        ]
        for options, message in refusals:
            with pytest.raises(UserError, match=message):
                seq.attend(0, q, **options)
        with pytest.raises(UserError, match=r"a budget count must be at least one block, got -1$"):
            seq.attend_partial(0, torch.randn(4, 2, 8), AttentionMode.SPARSE, budget=-1)
        seq.attend(0, q, AttentionMode.SPARSE, budget=2)
        assert [report.step for report in seq.reports] == [0, 1]
        cache.check_invariants()


# ----- F3: sparse-layout tensors are refused naming the argument --------------------------


@pytest.mark.parametrize("tokens", [1, 6])  # stays in the tail / fills a block
def test_sparse_layout_k_is_refused_naming_k(tokens):
    with _cache() as cache:
        seq = cache.sequence()
        seq.append(0, *_kv(3))
        k, v = _kv(tokens)
        with pytest.raises(UserError, match=r"^Sequence\.append: k must be a dense \(strided\) tensor, got layout torch\.sparse_coo$"):
            seq.append(0, k.to_sparse(), v.to_sparse())
        with pytest.raises(UserError, match=r"^Sequence\.append: v must be a dense \(strided\) tensor, got layout torch\.sparse_coo$"):
            seq.append(0, k, v.to_sparse())
        assert seq.length(0) == 3
        cache.check_invariants()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_layout_queries_are_refused_naming_q():
    with _cache() as cache:
        seq = cache.sequence()
        seq.append(0, *_kv(9))
        with pytest.raises(UserError, match=r"^Sequence\.attend: q must be a dense \(strided\) tensor, got layout torch\.sparse_coo$"):
            seq.attend(0, torch.randn(4, 1, 8).to_sparse())
        with pytest.raises(UserError, match=r"^Sequence\.attend_partial: q must be a dense \(strided\) tensor, got layout torch\.sparse_csr$"):
            seq.attend_partial(0, torch.randn(4, 2, 8).to_sparse_csr())
        seq.attend(0, torch.randn(4, 1, 8))
        assert [report.step for report in seq.reports] == [0]


# ----- F4: stream_source checks the sequence and the cache --------------------------------


def test_stream_source_of_a_freed_sequence_says_it_was_freed():
    with _cache(hbm=2, dram=2, window_blocks=2) as cache:
        seq = cache.sequence()
        seq.append(0, *_kv(8))
        seq.free()
        other = cache.sequence()
        other.append(0, *_kv(16))  # evicts the freed sequence's blocks
        with pytest.raises(UserError, match=r"^Sequence\.stream_source: the sequence was freed$"):
            seq.stream_source(0)


def test_stream_source_after_close_says_the_cache_is_closed():
    cache = _cache(hbm=2, dram=2, window_blocks=2)
    seq = cache.sequence()
    seq.append(0, *_kv(16))
    cache.close()
    with pytest.raises(UserError, match=r"^TieredKVCache: the cache is closed$"):
        seq.stream_source(0)


def test_stream_source_builds_its_source_under_the_store_lock(monkeypatch):
    with _cache(hbm=2, dram=2, window_blocks=2) as cache:
        seq = cache.sequence()
        seq.append(0, *_kv(16))
        real = sequence_module.TierChunks
        held: list[bool] = []

        def chunks(*args):
            held.append(cache.store._lock.held_by_this_thread())
            return real(*args)

        monkeypatch.setattr(sequence_module, "TierChunks", chunks)
        assert seq.stream_source(0).n_chunks == 2
        assert held == [True]


# ----- F5: attend_partial's errors name attend_partial ------------------------------------


def test_attend_partial_errors_name_attend_partial():
    with _cache() as cache:
        seq = cache.sequence()
        seq.append(0, *_kv(9))
        q = torch.randn(4, 2, 8)
        with pytest.raises(UserError, match=r"^Sequence\.attend_partial: a budget count must be at least one block, got 0$"):
            seq.attend_partial(0, q, AttentionMode.SPARSE, budget=0)
        with pytest.raises(UserError, match=r"^Sequence\.attend_partial: AttentionMode\.SPARSE needs a budget"):
            seq.attend_partial(0, q, AttentionMode.SPARSE)
        seq.free()
        with pytest.raises(UserError, match=r"^Sequence\.attend_partial: the sequence was freed$"):
            seq.attend_partial(0, q)
        with pytest.raises(UserError, match=r"^Sequence\.attend: the sequence was freed$"):
            seq.attend(0, torch.randn(4, 1, 8))


def test_a_remote_tier_is_refused_by_the_decode_cache_before_anything_opens():
    """Probe R12: an attend over a block demoted into a remote (Mooncake) tier crashed
    ('Tensor' object has no attribute 'ctypes'); the decode cache now refuses the tier up
    front, naming it and what to use instead. No master is needed: nothing connects."""
    from tiercache.config import RemoteConfig

    remote = RemoteConfig("127.0.0.1:1", "http://127.0.0.1:2/metadata")
    tiers = [TierConfig("hbm", 2), TierConfig("dram", 2), TierConfig("remote", 64, remote=remote)]
    with pytest.raises(UserError, match="remote \\(Mooncake\\) tier is not supported by the decode cache.*TieredKVStore"):
        TieredKVCache(KVLayout(1, 2, 16, "float32", 8), tiers, device="cpu")
