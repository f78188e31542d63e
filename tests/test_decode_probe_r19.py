"""Probe r19, finding 2 (the decode cache's close and reopen): a prefix hit needs every layer
of a block position, but a close whose NVMe tier could not take every content-keyed block, and
a reopen on a smaller NVMe tier, kept blocks in slot order: a prefill stores all of layer 0
before layer 1, so what was kept was layer 0 of many positions and layer 1 of few. A 40-token
prompt over 2 layers (20 per-layer blocks) kept in 12 slots matched 8 tokens where 24 (6 whole
positions) fit. Close now persists by ``WriteRanks`` (every layer of a position together,
earlier positions first) and writes the order file a smaller reopen keeps blocks by
(``lifecycle.ORDER_FILE``): the store hands out freed slots first, so slots alone say nothing.
"""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tiercache import TieredKVCache
from tiercache.attention import dense_reference
from tiercache.config import KVLayout, TierConfig
from tiercache.keys import layer_key, prefix_keys
from tiercache.live.cache import PersistWarning, WriteRanks
from tiercache.live.lifecycle import ORDER_FILE, UNRANKED, read_order

BLOCK_TOKENS = 4
PROMPT = list(range(100, 140))  # 10 blocks of 4 tokens
OTHER = list(range(300, 340))


def _layout(layers: int) -> KVLayout:
    return KVLayout(layers=layers, kv_heads=2, head_dim=8, dtype="float32", block_tokens=BLOCK_TOKENS)


def _cache(path, layers: int = 2, hbm: int = 32, dram: int = 32, nvme: int = 64, **options) -> TieredKVCache:
    tiers = [TierConfig("hbm", hbm), TierConfig("dram", dram), TierConfig("nvme", nvme)]
    return TieredKVCache(_layout(layers), tiers, path=path, device="cpu", **options)


def _prefill(cache: TieredKVCache, tokens: list[int], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Stores ``tokens``' KV (random, per layer, layer 0 first as a prefill does) and frees the
    sequence; returns the KV appended per layer (``[kv_heads, tokens, head_dim]`` each)."""
    g = torch.Generator().manual_seed(seed)
    seq = cache.sequence(tokens=tokens)
    kv = [(torch.randn(2, len(tokens), 8, generator=g), torch.randn(2, len(tokens), 8, generator=g))
          for _ in range(cache.layout.layers)]
    for layer, (k, v) in enumerate(kv):
        seq.append(layer, k, v)
    seq.free()
    return kv


def _close_quietly(cache: TieredKVCache) -> tuple[int, int]:
    """Closes ``cache``; returns (saved, left out) (left out from its ``PersistWarning``, 0 if none)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = cache.close()
    cut = [w.message for w in caught if isinstance(w.message, PersistWarning)]
    return saved, (cut[0].left_out if cut else 0)


def _cache_media(path) -> SimpleNamespace:
    """A stand-in medium whose directory is ``path`` (``read_order`` reads its file there)."""
    return SimpleNamespace(path=str(path))


def _serves_what_was_written(cache: TieredKVCache, tokens: list[int], kv) -> int:
    """The prefix ``cache`` serves of ``tokens``; asserts a sequence reusing it attends, at every
    layer, exactly as dense attention over the KV written for those tokens (the reused blocks
    hold the bytes written, whole positions only). Returns the tokens served."""
    served = cache.match_prefix(tokens)
    seq = cache.sequence(tokens=tokens + [7])
    assert seq.cached_tokens == served
    if served:
        q = torch.randn(2, 1, 8, generator=torch.Generator().manual_seed(served))
        for layer, (k, v) in enumerate(kv):
            out = seq.attend(layer, q)
            ref = dense_reference(q, k[:, :served], v[:, :served])
            assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6), f"layer {layer}"
    seq.free()
    return served


def _positions_on_nvme(cache: TieredKVCache, tokens: list[int]) -> list[int]:
    """Per block position of ``tokens``: how many of its layers the NVMe tier's store holds."""
    stored = {key for key, _ in cache.store._media[2].items()}
    return [sum(layer_key(key, layer) in stored for layer in range(cache.layout.layers))
            for key in prefix_keys(tokens, BLOCK_TOKENS)]


def _whole_prefix(counts: list[int], layers: int) -> int:
    """Tokens of the longest run of leading positions holding every layer."""
    whole = next((p for p, n in enumerate(counts) if n < layers), len(counts))
    return whole * BLOCK_TOKENS


@pytest.mark.parametrize("layers", [2, 3])
def test_a_reopen_on_a_smaller_nvme_tier_keeps_whole_positions(tmp_path, layers):
    """Before the fix (2 layers): 8 tokens (slots 0..11 held layer 0 of 10 positions, layer 1 of 2).
    12 slots keep 12 // layers whole positions, and their KV is what was written."""
    cache = _cache(tmp_path, layers)
    kv = _prefill(cache, PROMPT)
    assert _close_quietly(cache) == (10 * layers, 0)
    with _cache(tmp_path, layers, nvme=12) as again:
        again.check_invariants()
        assert _serves_what_was_written(again, PROMPT, kv) == (12 // layers) * BLOCK_TOKENS
        assert _positions_on_nvme(again, PROMPT) == [layers] * (12 // layers) + [0] * (10 - 12 // layers)


@pytest.mark.parametrize("layers", [2, 3])
def test_a_persist_cut_short_saves_whole_positions(tmp_path, layers):
    """NVMe takes 12 of the 20 (30) blocks: before the fix the 12 were layer 0's 10 and layer
    1's first 2 (8 tokens served). Now (saved // layers) whole positions are served."""
    cache = _cache(tmp_path, layers, nvme=12)
    kv = _prefill(cache, PROMPT)
    saved, left_out = _close_quietly(cache)
    assert (saved, left_out) == (12, 10 * layers - 12)
    with _cache(tmp_path, layers, nvme=12) as again:
        assert _serves_what_was_written(again, PROMPT, kv) >= (saved // layers) * BLOCK_TOKENS
        assert again.match_prefix(PROMPT) == (12 // layers) * BLOCK_TOKENS


def test_a_write_through_cache_reopened_smaller_keeps_whole_positions(tmp_path):
    """Write-through: every block has its NVMe copy when stored, so close moves none (0),
    and only the order file, listing them all, decides what 12 slots keep."""
    cache = _cache(tmp_path, write_through=True)
    kv = _prefill(cache, PROMPT)
    assert _close_quietly(cache) == (0, 0)
    assert len(read_order(_cache_media(tmp_path))) == 20
    with _cache(tmp_path, nvme=12, write_through=True) as again:
        assert _serves_what_was_written(again, PROMPT, kv) == 24


def test_two_sequences_cut_short_each_keep_a_whole_prefix(tmp_path):
    """Two prompts decoded as a batch (per layer, both rows, one order): what a short persist
    keeps is a prefix of each, and together they serve every saved block."""
    cache = _cache(tmp_path, nvme=18)
    rows = [cache.sequence(tokens=PROMPT), cache.sequence(tokens=OTHER)]
    kv = [[(torch.randn(2, 40, 8), torch.randn(2, 40, 8)) for _ in range(2)] for _ in rows]
    for layer in range(2):
        for row, seq in enumerate(rows):
            seq.append(layer, *kv[row][layer])
    for seq in rows:
        seq.free()
    saved, left_out = _close_quietly(cache)
    assert (saved, left_out) == (18, 22)
    with _cache(tmp_path, nvme=18) as again:
        served = [_serves_what_was_written(again, tokens, kv[row]) for row, tokens in enumerate([PROMPT, OTHER])]
        assert sum(served) == (saved // 2) * BLOCK_TOKENS
        for tokens, tokens_served in zip([PROMPT, OTHER], served):  # whole positions, a prefix of each, nothing torn
            whole = tokens_served // BLOCK_TOKENS
            assert _positions_on_nvme(again, tokens) == [2] * whole + [0] * (10 - whole)


def test_blocks_spilled_before_close_are_completed_first_and_never_torn(tmp_path):
    """HBM 4 and DRAM 4 blocks: the prefill spills 12 of the 20 blocks to NVMe (16 slots), 4
    are free at close. The persist fills them with the missing layers of the earliest
    positions, so the reopen serves the longest whole prefix those 4 can complete, with the
    KV written; a reopen on 6 slots then keeps 3 whole positions of it (the order file, not
    the slots, says which)."""
    cache = _cache(tmp_path, hbm=4, dram=4, nvme=16)
    kv = _prefill(cache, PROMPT)
    before = _positions_on_nvme(cache, PROMPT)
    assert sum(before) == 12
    missing = np.cumsum([2 - n for n in before])  # blocks the first p + 1 positions lack on NVMe
    best = int((missing <= 4).sum()) * BLOCK_TOKENS  # the longest prefix 4 more blocks make whole
    assert best > _whole_prefix(before, 2)
    assert _close_quietly(cache) == (4, 4)
    with _cache(tmp_path, hbm=4, dram=4, nvme=16) as again:
        assert _serves_what_was_written(again, PROMPT, kv) == best
    with _cache(tmp_path, hbm=4, dram=4, nvme=6) as again:
        again.check_invariants()
        assert _serves_what_was_written(again, PROMPT, kv) == min(best, 3 * BLOCK_TOKENS)
        assert _positions_on_nvme(again, PROMPT)[:3] == [2, 2, 2]


def test_a_smaller_reopen_after_scratch_spills_keeps_whole_positions(tmp_path):
    """A decode without ids spilled scratch blocks to NVMe; close deletes them, and the store
    hands their freed slots out first, in no position order, to the prompt's blocks: slot
    order alone kept torn positions there. The order file keeps 6 whole ones."""
    cache = _cache(tmp_path, hbm=4, dram=4, nvme=64)
    scratch = cache.sequence()
    for layer in range(2):
        scratch.append(layer, torch.randn(2, 32, 8), torch.randn(2, 32, 8))
    scratch.free()
    kv = _prefill(cache, PROMPT)
    assert _close_quietly(cache) == (8, 0)
    with _cache(tmp_path, hbm=4, dram=4, nvme=64) as again:  # everything fits: all 10 positions
        assert _positions_on_nvme(again, PROMPT) == [2] * 10
    listed = read_order(_cache_media(tmp_path))
    assert len(listed) == 20
    with _cache(tmp_path, hbm=4, dram=4, nvme=12) as again:
        assert _serves_what_was_written(again, PROMPT, kv) == 24


def test_adopted_blocks_keep_their_place_in_the_next_order_file(tmp_path):
    """A reopen seeds the persist order with the order file's blocks: a second session's
    prompt ranks after them, so a third, smaller reopen keeps the first prompt whole."""
    cache = _cache(tmp_path)
    first = _prefill(cache, PROMPT)
    _close_quietly(cache)
    with _cache(tmp_path) as again:
        _prefill(again, OTHER, seed=1)
    with _cache(tmp_path, nvme=24) as again:
        assert _serves_what_was_written(again, PROMPT, first) == 40
        assert again.match_prefix(OTHER) == 8


def test_a_damaged_order_file_is_ignored(tmp_path):
    """A flipped byte in the order file: the reopen keeps blocks by slot, as without one,
    and still serves only KV that was written."""
    cache = _cache(tmp_path)
    kv = _prefill(cache, PROMPT)
    _close_quietly(cache)
    with open(os.path.join(tmp_path, ORDER_FILE), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert read_order(_cache_media(tmp_path)) == []
    with _cache(tmp_path, nvme=12) as again:
        again.check_invariants()
        _serves_what_was_written(again, PROMPT, kv)


def test_write_ranks_pair_layers_by_position_and_survive_compaction():
    """Ranks: ordinal * layers + layer of a block's latest write; scratch ids are counted,
    not logged; compaction keeps the stored blocks' latest ranks only."""
    ranks = WriteRanks(2)
    ranks.seed(np.array([90, 91], dtype=np.int64))
    ranks.wrote(0, [10, 11, 12], scratch={12})
    ranks.wrote(1, [20, 21, 22], scratch=set())
    assert ranks.of([90, 91, 10, 20, 11, 21, 22, 12, 5]).tolist() == [0, 1, 2, 3, 4, 5, 7, UNRANKED, UNRANKED]
    ranks.wrote(0, [10], scratch=set())  # written again: its latest write ranks it
    assert ranks.of([10]).tolist() == [8]
    ranks.compact({10, 21, 91})
    assert ranks.n == 3
    assert ranks.of([91, 21, 10, 20]).tolist() == [1, 5, 8, UNRANKED]
