"""Probe Q67 finding (threads on one cache: every attend matched the float64 reference, counts
added up): ``cache.sequence(tokens=...)`` checked that the cache was open before taking the
store's lock, so a ``close`` from another thread in between let the new sequence reuse its
prefix on the closed cache (no error, a write to the closed record file, or the NVMe layer's
own "store is closed")."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tiercache import TieredKVCache
from tiercache.config import KVLayout, TierConfig

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="float32", block_tokens=4)


@pytest.mark.parametrize("hbm,record", [(64, False), (2, False), (64, True)])
def test_a_sequence_started_as_another_thread_closes_the_cache_is_refused(tmp_path, hbm, record):
    tiers = [TierConfig("hbm", hbm), TierConfig("dram", 2), TierConfig("nvme", 64)]
    cache = TieredKVCache(LAYOUT, tiers, path=tmp_path / "nvme", device="cpu",
                          record=tmp_path / "steps.jsonl" if record else None)
    prompt = list(range(16))
    seq = cache.sequence(tokens=prompt)
    for layer in range(2):
        seq.append(layer, torch.randn(2, 16, 16), torch.randn(2, 16, 16))
    seq.free()
    outcome = {}

    def start():
        try:
            cache.sequence(tokens=prompt + [99])
            outcome["made"] = True
        except Exception as exc:  # noqa: BLE001 - what it raised is the finding
            outcome["raised"] = f"{type(exc).__name__}: {exc}"

    checked = threading.Event()
    check_open = cache._check_open

    def check_then_signal():  # sequence()'s own check, outside the lock
        check_open()
        if threading.current_thread() is opener:
            checked.set()

    cache._check_open = check_then_signal
    cache.store._lock.__enter__()  # another thread's call in progress: the new sequence waits for the lock
    opener = threading.Thread(target=start)
    opener.start()
    assert checked.wait(10)  # it passed sequence()'s check
    time.sleep(0.1)  # and reached the lock
    try:
        cache.close()  # the close that wins the lock first (reentrant here: the same thread)
    finally:
        try:
            cache.store._lock.__exit__(None, None, None)
        except Exception:  # noqa: BLE001 - the stand-in call ends on a closed store
            pass
    opener.join(10)
    assert outcome == {"raised": "UserError: TieredKVCache: the cache is closed"}
