"""Review R41 findings on this session's NVMe folder descriptor (83f6e39) and its fixes:

- R41-1 (high): a close that timed out closed the folder's descriptor under a write still in
  flight; the next folder opened took its number, and the write landed there, over another
  store's chunk.
- R41-2 (high): an open racing a folder replacement locked the old folder, read and wrote the
  new one by path, and wrote the empty index of a new store into the old one through the
  descriptor: its blocks were swept at its next open.
- R41-3: the scratch-tag marker was still written by path.
- R41-5/6: ``previous_access`` truncated float ids; the numpy path of ``distance_counts``
  failed on a next-use array whose -1 was read through an unsigned type.
- R41-8: a results file older than version 9 could hold the route ``kv_aware``.
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest
import torch

from tiercache.cli import main
from tiercache.data import chunkio
from tiercache.data.nvme import NVMeStore
from tiercache.data.nvme_lock import StoreLock
from tiercache.errors import UserError
from tiercache.live.lifecycle import FORMAT_MARKER, mark_tagged
from tiercache.results import read_results
from tiercache.sim import mrc, stackdist

from store_helpers import LAYOUT, blocks, key


def test_a_write_outliving_a_timed_out_close_stays_in_its_own_folder(tmp_path, monkeypatch):
    real, started = chunkio.write_chunk_file, threading.Event()

    def slow(*args, **kwargs):
        started.set()
        time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(chunkio, "write_chunk_file", slow)
    first = NVMeStore(tmp_path / "a", LAYOUT, capacity_blocks=8, overwrite_in_place=False)
    pending = first.submit_put([key(0)], blocks(1, 1))
    assert started.wait(5)
    first.close_timeout_s = 0.2
    with pytest.raises(OSError, match="did not finish"):
        first.close()
    monkeypatch.setattr(chunkio, "write_chunk_file", real)
    second = NVMeStore(tmp_path / "b", LAYOUT, capacity_blocks=8)  # may take the first's old descriptor number
    data = blocks(1, 2)
    assert second.put([key(5)], data)[0].ok
    second.flush()
    pending.result(timeout=10)  # the first's write, done now
    out = torch.empty_like(data)
    assert second.get([key(5)], out) == [True] and torch.equal(out, data)
    assert second.stats["corrupt_reads"] == 0
    second.close()
    assert any(name.startswith("c.") for name in os.listdir(tmp_path / "a"))  # where it belonged


def test_an_open_racing_a_folder_replacement_is_refused_and_the_old_store_keeps_its_blocks(tmp_path, monkeypatch):
    path, archived = tmp_path / "s", tmp_path / "archived"
    with NVMeStore(path, LAYOUT, capacity_blocks=16) as store:
        store.put([key(i) for i in range(4)], blocks(4, 3))
    real = StoreLock.acquire.__func__

    def acquire_then_replace(cls, root):
        lock = real(cls, root)
        if not archived.exists():
            os.rename(path, archived)
            os.mkdir(path)
        return lock

    monkeypatch.setattr(StoreLock, "acquire", classmethod(acquire_then_replace))
    with pytest.raises(UserError, match="the store's folder was replaced while it opened; open it again"):
        NVMeStore(path, LAYOUT, capacity_blocks=16)
    monkeypatch.undo()
    with NVMeStore(archived, LAYOUT) as reopened:
        assert len(reopened) == 4 and reopened.stats["garbage_removed"] == 0
    with NVMeStore(path, LAYOUT, capacity_blocks=16) as fresh:  # opened again, as the message says
        assert len(fresh) == 0


def test_the_scratch_tag_marker_goes_to_the_folder_the_store_opened(tmp_path):
    path, moved = tmp_path / "s", tmp_path / "moved"
    with NVMeStore(path, LAYOUT, capacity_blocks=4) as store:
        os.rename(path, moved)
        path.mkdir()
        mark_tagged(store, 0)
        assert not (path / FORMAT_MARKER).exists() and (moved / FORMAT_MARKER).exists()
        os.rmdir(path)
        os.rename(moved, path)  # back, for its close


@pytest.mark.parametrize("numba", [True, False], ids=["numba", "numpy"])
def test_previous_access_and_unsigned_next_uses_read_alike_on_both_paths(numba, monkeypatch):
    if numba and not mrc.HAVE_NUMBA:
        pytest.skip("numba not installed")
    monkeypatch.setattr(mrc, "HAVE_NUMBA", numba)
    with pytest.raises(ValueError, match="ids must be integers"):
        mrc.previous_access([0.5, 0.7])
    ids = np.random.default_rng(41).integers(0, 20, 300)
    unsigned = stackdist.next_positions(ids).astype(np.int64).astype(np.uint32)  # -1 read as 2**32 - 1
    assert np.array_equal(mrc.distance_counts(ids, following=unsigned), mrc.distance_counts(ids))


def test_a_results_file_older_than_version_9_cannot_hold_kv_aware(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 1,
                                         "hash_ids": [i % 3, 10 + i]}) + "\n" for i in range(12)))
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--instances", "2", "--route", "kv_aware", "--tiers", "hbm=4,remote=8",
                 "--no-progress", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    for version, readable in ((9, True), (8, False), (5, False)):
        data["schema_version"] = version
        out.write_text(json.dumps(data))
        if readable:
            assert read_results(out).runs[0].route.value == "kv_aware"
        else:
            with pytest.raises(UserError, match=f"route' kv_aware is not one schema version {version} could record"):
                read_results(out)
