"""Probe q21 (the decode cache's close and appends, raw API): ``close()`` kept scratch blocks
(private keys, which nothing can name again) that had spilled to NVMe, so a prompt's
content-keyed blocks found no free NVMe slot and were silently not persisted, and a reopen
adopted the scratch; an append that a full disk stopped raised a bare RuntimeError naming
no OS error; ``keep_reports`` beyond ``sys.maxsize`` was accepted, then every
``sequence()`` raised OverflowError.

The cache here: HBM 4, DRAM 4, NVMe 16 per-layer blocks, 2 layers. A generation without
ids (8 blocks a layer: 16 scratch blocks) is freed, then a 4-block prompt (8 content-keyed
blocks) is stored: NVMe holds the 16 scratch blocks, HBM and DRAM the prompt.
"""

from __future__ import annotations

import errno
import os
import pickle
import sys
import warnings

import pytest
import torch

from decode_helpers import LAYOUT, random_kv as _kv  # q19 moved them there (4b950fc)
from test_nvme_promote_durable import killed
from test_retained_failed_write import disk_full
from tiercache import TieredKVCache
from tiercache.config import TierConfig
from tiercache.errors import UserError
from tiercache.live.cache import PersistWarning
from tiercache.live.keymap import is_scratch
from tiercache.live.writeback import WriteBackError

PROMPT = list(range(500, 516))  # 4 blocks of LAYOUT's 4 tokens


def _cache(path, nvme: int = 16, **options) -> TieredKVCache:
    tiers = [TierConfig("hbm", 4), TierConfig("dram", 4), TierConfig("nvme", nvme)]
    return TieredKVCache(LAYOUT, tiers, path=path, device="cpu", **options)


def _scratch_then_prompt(cache: TieredKVCache, tokens: int = 32) -> None:
    """``tokens / 4`` scratch blocks a layer (16: all on NVMe in the end), then the prompt's
    8 blocks, in HBM and DRAM."""
    generation = cache.sequence()
    for layer in range(2):
        generation.append(layer, *_kv(tokens))
    generation.free()
    prompt = cache.sequence(tokens=PROMPT)
    for layer in range(2):
        prompt.append(layer, *_kv(16))
    prompt.free()
    assert cache.match_prefix(PROMPT) == 16


def _nvme_keys(cache: TieredKVCache) -> list[bytes]:
    """The keys of the blocks the NVMe tier's store holds."""
    return [key for key, _ in cache.store._media[2].items()]


def _reopened(path, nvme: int = 16) -> tuple[int, int, int]:
    """A reopen's matched prefix, its NVMe blocks and the scratch keys its NVMe store holds."""
    with _cache(path, nvme) as again:
        again.check_invariants()
        held = _nvme_keys(again)
        return again.match_prefix(PROMPT), len(held), sum(is_scratch(key) for key in held)


@pytest.mark.parametrize("write_through", [False, True])
def test_close_deletes_scratch_from_nvme_so_the_prompt_is_kept_and_says_what_did_not_fit(tmp_path, write_through):
    """Before the fix close returned None, the reopen matched 0 of 16 tokens and adopted the
    16 scratch blocks (under ``write_through`` every scratch block had its NVMe copy)."""
    path = tmp_path / "kept"
    cache = _cache(path, write_through=write_through)
    _scratch_then_prompt(cache)
    assert sum(is_scratch(key) for key in _nvme_keys(cache)) >= 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # everything fits: no warning
        assert cache.close() == (0 if write_through else 8)  # write-through: the prompt is on NVMe already
    assert _reopened(path) == (16, 8, 0)

    dropped = tmp_path / "dropped"  # persist=False keeps what NVMe held, but never scratch
    cache = _cache(dropped, write_through=write_through)
    _scratch_then_prompt(cache)
    assert cache.close(persist=False) == 0
    assert _reopened(dropped)[1:] == ((8, 0) if write_through else (0, 0))

    crashed = _cache(tmp_path / "crashed", write_through=write_through)  # a kill: no close ran
    _scratch_then_prompt(crashed)
    crashed.store.flush()
    copy = killed(tmp_path / "crashed", tmp_path)
    crashed.close(persist=False)
    assert _reopened(copy)[2] == 0  # a reopen never adopts a scratch block
    with _cache(copy) as again:
        assert not any(is_scratch(key) for key in again.store._map.keys.values())

    small = _cache(tmp_path / "small", nvme=5)  # the prompt's 8 blocks do not fit in 5 slots
    _scratch_then_prompt(small, tokens=4)
    with pytest.warns(PersistWarning, match=r"^TieredKVCache.close: 3 of 8 content-keyed blocks .* \(5 were saved\)") as caught:
        assert small.close() == 5
    assert (caught[0].message.saved, caught[0].message.left_out) == (5, 3)
    assert pickle.loads(pickle.dumps(caught[0].message)).left_out == 3


def test_an_append_stopped_by_a_full_disk_raises_an_oserror_naming_enospc_and_the_file(tmp_path, monkeypatch):
    """A decode whose demotion into NVMe fails with ENOSPC: the append raised RuntimeError
    '(every HBM slot pinned, or a write-back failed)', no OS error, no path, no cause."""
    cache = _cache(tmp_path / "full", nvme=64)
    seq = cache.sequence()
    for layer in range(2):
        seq.append(layer, *_kv(32))  # 8 blocks a layer: HBM and DRAM full
    disk_full(monkeypatch)
    with pytest.raises(WriteBackError) as caught:
        for layer in range(2):
            seq.append(layer, *_kv(4))
    error = caught.value
    assert isinstance(error, OSError) and isinstance(error, RuntimeError)
    assert error.errno == errno.ENOSPC and str(tmp_path / "full") in error.filename
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.ENOSPC
    message = str(error)
    assert message.startswith("Sequence.append: 1 block(s) of layer 0 could not be stored (a write into the NVMe tier")
    assert "ENOSPC" in message and os.strerror(errno.ENOSPC) in message and error.filename in message
    assert message.endswith("nothing was appended")
    again = pickle.loads(pickle.dumps(error))
    assert (str(again), again.errno, again.filename) == (message, error.errno, error.filename)
    assert seq.length(0) == 32  # nothing appended
    monkeypatch.undo()
    seq.append(0, *_kv(4))
    assert seq.length(0) == 36
    cache.check_invariants()
    cache.close()


def test_keep_reports_beyond_sys_maxsize_is_refused_naming_the_option(tmp_path):
    """``keep_reports=10**19`` and ``2**63`` were accepted; every ``sequence()`` then raised
    'OverflowError: Python int too large to convert to C ssize_t'."""
    for keep in (10**19, sys.maxsize + 1):
        with pytest.raises(UserError, match=rf"^TieredKVCache: keep_reports must be at most sys.maxsize \({sys.maxsize}"):
            _cache(tmp_path, keep_reports=keep)
    with _cache(tmp_path, keep_reports=sys.maxsize) as cache:
        seq = cache.sequence()
        seq.append(0, *_kv(6))
        seq.attend(0, torch.randn(2, 1, 8))
        assert len(seq.reports) == 1
        seq.free()
