"""Ctrl-C (KeyboardInterrupt) while a store call waits for a move in flight: the move keeps
running on its I/O thread, so the engine must keep its job, and a later wait must settle it
normally. Before, the engine forgot the job, the manager later failed it and freed its
destination slot, a new block was stored there, and the still-running read overwrote it: a
later ``get`` returned another key's bytes."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from store_helpers import LAYOUT, blocks, key
from tiercache.config import TierConfig
from tiercache.data import chunkio
from tiercache.live.store import TieredKVStore


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
def test_an_interrupted_wait_keeps_the_move_and_no_block_is_overwritten(tmp_path, monkeypatch):
    gate = threading.Event()
    read = chunkio.read_chunk_file

    def gated_read(*args, **kwargs):
        gate.wait(20)
        return read(*args, **kwargs)

    tiers = [TierConfig("hbm", 1), TierConfig("dram", 1), TierConfig("nvme", 3)]
    data = blocks(6, 11)
    keys = [key(i) for i in range(6)]
    with TieredKVStore(LAYOUT, tiers, path=tmp_path / "nvme", device="cpu") as store:
        store.put(keys[:4], data[:4])
        assert store.lookup(keys[:1])[1] == ["nvme"]
        monkeypatch.setattr(chunkio, "read_chunk_file", gated_read)
        store.prefetch(keys[:1])  # NVMe -> HBM, held at the gate
        timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            store.put(keys[4:5], data[4:5])  # must make room: waits for the prefetch
        timer.join()
        release = threading.Timer(0.5, gate.set)
        release.start()
        store.wait()  # settles the prefetch once its read lands (it never forgets it)
        store.put(keys[5:6], data[5:6])  # takes a free HBM slot
        release.join()
        time.sleep(0.5)  # a read the engine had forgotten would land in that slot now
        store.check_invariants()
        for i in range(6):
            if store.lookup(keys[i : i + 1])[1][0] is not None:
                assert torch.equal(store.get(keys[i : i + 1])[0], data[i]), i
