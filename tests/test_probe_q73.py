"""Probe Q73: data an older tiercache wrote is refused as such, or tidied, never called damage.

- An NVMe index snapshot of the first format (its crc covered the body alone; headers were
  sealed in later) is refused as written by an older tiercache, not as a damaged snapshot.
- Parsed-trace cache entries of the first version (``<blake2b hex>-v1``) are removed by the
  next write's tidy, like any entry no reader reads; unrelated folders stay.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from tiercache.config import KVLayout
from tiercache.data import nvme_index
from tiercache.data.chunkio import crc32c
from tiercache.data.nvme import NVMeStore
from tiercache.errors import UserError
from tiercache.sim.tracecache import load_trace_cached

HEAD = Path(__file__).parent / "data" / "mooncake_head.jsonl"
LAYOUT = KVLayout(layers=1, kv_heads=1, head_dim=8, dtype="float16", block_tokens=4)


def _unseal(snapshot) -> None:
    """Rewrites a snapshot's crc as the first format's: over the body alone."""
    raw = bytearray(snapshot.read_bytes())
    header = struct.Struct("<4sQQI")
    body = bytes(raw[header.size :])
    raw[header.size - 4 : header.size] = crc32c(np.frombuffer(body, np.uint8)).to_bytes(4, "little")
    snapshot.write_bytes(bytes(raw))


def test_first_format_snapshot_is_refused_as_older(tmp_path):
    NVMeStore(tmp_path / "s", LAYOUT, 2).close()
    snapshot = tmp_path / "s" / nvme_index.SNAPSHOT_NAME
    _unseal(snapshot)
    with pytest.raises(UserError, match=r"tiercache.index: index snapshot written by an older tiercache") as caught:
        NVMeStore(tmp_path / "s", LAYOUT)
    assert "damaged" not in str(caught.value)


def test_damaged_snapshot_is_still_called_damaged(tmp_path):
    NVMeStore(tmp_path / "s", LAYOUT, 2).close()
    snapshot = tmp_path / "s" / nvme_index.SNAPSHOT_NAME
    raw = bytearray(snapshot.read_bytes())
    raw[5] ^= 0xFF
    raw[6] ^= 0xFF  # two bytes: past the one-bit repair
    snapshot.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="index snapshot damaged"):
        NVMeStore(tmp_path / "s", LAYOUT)


def test_first_version_trace_cache_entries_are_tidied(tmp_path):
    cache = tmp_path / "cache"
    old = cache / ("0123456789abcdef" * 2 + "-v1")
    old.mkdir(parents=True)
    (old / "ids.npy").write_bytes(b"x" * 100)
    unrelated = cache / "notes-v1"
    unrelated.mkdir()
    trace = load_trace_cached(HEAD, cache)
    assert len(trace.ids) > 0
    assert not old.exists()
    assert unrelated.exists()
