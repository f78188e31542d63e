"""Probe q19 (the decode cache, raw API): a normal ``close`` of a ``TieredKVCache`` dropped every
block held in HBM and DRAM, so a cache reopened on the same path (another process) reused no
prefix; ``seq.reports`` grew by one ``StepReport`` per read without bound; ``match_prefix``,
``sequence(tokens=)`` and ``add_tokens`` took a ``[b, n]`` batch as one sequence of its rows
run together."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiercache import TieredKVCache
from tiercache.config import KVLayout, TierConfig

from tiercache.errors import UserError

from decode_helpers import random_kv, small_cache

_cache, _kv = small_cache, random_kv


def test_a_normal_close_keeps_content_keyed_blocks_for_a_reopen_and_writes_no_scratch(tmp_path):
    """The prompt's 5 blocks per layer and 3 more of generated ids told with ``add_tokens``
    fit in HBM and DRAM; 3 blocks per layer of untold ids (private keys) are scratch. Before
    the fix the ``with`` exit (``persist=False``) dropped them all: the reopen matched 0."""
    prompt = list(range(1, 22))  # 21 tokens: 5 whole blocks
    told = list(range(100, 112))  # 12 generated tokens whose ids are told: 3 more blocks
    with _cache(tmp_path) as cache:
        seq = cache.sequence(tokens=prompt)
        for layer in range(2):
            seq.append(layer, *_kv(21))
        seq.add_tokens(told)
        for layer in range(2):
            seq.append(layer, *_kv(11))  # completes block 5, then blocks 6, 7
        other = cache.sequence()  # no ids: private keys
        for layer in range(2):
            other.append(layer, *_kv(12))
        scratch = set(other._held_ids())
        seq.free()
        other.free()
        assert not any(cache.manager.dirs[2].slot_of)  # everything still in HBM and DRAM
        assert len(scratch) == 6
    with _cache(tmp_path) as again:
        assert again.match_prefix(prompt + told) == 32
        nvme = again.manager.dirs[2].slot_of
        assert len(nvme) == 16 and not scratch & set(nvme)  # 8 content blocks x 2 layers; no scratch written
        reused = again.sequence(tokens=prompt + told + [7])
        assert reused.cached_tokens == 32
        reused.free()
        again.check_invariants()


def test_a_sequence_keeps_only_its_last_keep_reports_step_reports(tmp_path):
    """2,100 exact reads of one layer: the sequence keeps the latest 1,024 reports (the
    default) or more, at most 2,048 (probe r15: the 2,049th read dropped the oldest down to the
    last 1,024 at once), oldest dropped first, and slicing and indexing still read them;
    ``keep_reports`` sets the bound (0: none). Before the fix it kept every one."""
    layout = KVLayout(layers=1, kv_heads=1, head_dim=4, dtype="float32", block_tokens=4)
    q = torch.randn(1, 1, 4)
    with TieredKVCache(layout, [TierConfig("hbm", 4)], device="cpu") as cache:
        seq = cache.sequence()
        seq.append(0, torch.randn(1, 6, 4), torch.randn(1, 6, 4))
        for _ in range(2100):
            seq.attend(0, q)
        assert len(seq.reports) == 1024 + 51, len(seq.reports)
        assert cache.keep_reports == 1024
        assert [r.step for r in seq.reports] == list(range(2100 - 1075, 2100))
        assert [r.step for r in seq.reports[-3:]] == [2097, 2098, 2099]
        assert seq.reports[-1].selected == 1 and seq.reports[-1].tail_tokens == 2
    with TieredKVCache(layout, [TierConfig("hbm", 4)], device="cpu", keep_reports=0) as cache:
        seq = cache.sequence()
        seq.append(0, torch.randn(1, 6, 4), torch.randn(1, 6, 4))
        seq.attend(0, q)
        assert len(seq.reports) == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(UserError, match="keep_reports must be an integer >= 0"):
            TieredKVCache(layout, [TierConfig("hbm", 4)], device="cpu", keep_reports=bad)


def test_one_sequences_ids_are_taken_as_n_or_1_by_n_and_a_batch_is_refused(tmp_path):
    """``match_prefix([[1, 2, 3, 4], [5, 6, 7, 8]])`` answered for ids 1..8 as one prompt; a
    batch is now refused naming its shape by ``match_prefix``, ``sequence(tokens=)`` and
    ``add_tokens``, while ``[n]`` and ``[1, n]`` (lists, arrays, tensors) are taken."""
    with _cache(tmp_path) as cache:
        seq = cache.sequence(tokens=list(range(1, 10)))
        for layer in range(2):
            seq.append(layer, *_kv(9))
        seq.free()
        batch = [[1, 2, 3, 4], [5, 6, 7, 8]]
        message = r"^tokens: one sequence's ids \(\[n\] or \[1, n\]\) expected, got shape \(2, 4\)"
        for tokens in (batch, np.array(batch), torch.tensor(batch)):
            with pytest.raises(UserError, match=message):
                cache.match_prefix(tokens)
            with pytest.raises(UserError, match=message):
                cache.sequence(tokens=tokens)
        with pytest.raises(UserError, match=r"^tokens: .*got shape \(1, 1, 9\)"):
            cache.match_prefix(torch.arange(1, 10).view(1, 1, 9))
        live = cache.sequence()
        with pytest.raises(UserError, match=r"^token_ids: .*got shape \(2, 2\)"):
            live.add_tokens([[1, 2], [3, 4]])
        assert len(live.token_ids) == 0
        live.add_tokens(torch.tensor([[1, 2]]))
        assert live.token_ids.tolist() == [1, 2]
        live.free()
        for tokens in (list(range(1, 10)), np.arange(1, 10)[None, :], torch.arange(1, 10).view(1, 9)):
            assert cache.match_prefix(tokens) == 8
        cache.check_invariants()
