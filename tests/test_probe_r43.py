"""Review R43 findings on the NVMe store's deferred release (b07ba6d) and the codecs' head cap:

- R43-1 (high, older than b07ba6d): ``flush()`` on a closed store wrote through index files
  whose descriptors were another store's by then (its snapshot replaced, its journal cut).
- R43-2/3: a worker calling ``shutdown_within``/``after_threads`` (a store collected in its
  own I/O thread, a ``close`` in a future's done-callback) waited for itself: the release was
  deferred, and the close reported ETIMEDOUT although nothing was in flight.
- R43-4: a fork while a release ran on another thread could leave the child the flock.
- R43-5: ``NVMeStore`` itself took a quantised codec for heads wider than its int16 channel
  ids, and the cap was one too low (ids 0..32767 fit: 32768 channels).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tiercache.config import CODEC_MAX_HEAD_DIM, KVLayout
from tiercache.data import nvme_lock
from tiercache.data.iojobs import after_threads, shutdown_within
from tiercache.data.nvme import NVMeStore
from tiercache.errors import ConfigError, UserError

from store_helpers import LAYOUT, blocks, key


def test_flush_after_close_is_refused(tmp_path):
    store = NVMeStore(tmp_path / "s", LAYOUT, capacity_blocks=8)
    store.put([key(0)], blocks(1, 1))
    store.close()
    with pytest.raises(UserError, match="store is closed"):
        store.flush()


def test_a_worker_between_tasks_neither_waits_for_itself_nor_defers():
    executor = ThreadPoolExecutor(2)
    executor.submit(time.sleep, 0.01).result()

    def in_worker():
        ran = []
        began = time.monotonic()
        finished = shutdown_within(executor, 2.0)
        after_threads(executor, lambda: ran.append(threading.current_thread()))
        return finished, time.monotonic() - began, ran

    finished, waited, ran = executor.submit(in_worker).result(timeout=10)
    assert finished and waited < 1.0 and len(ran) == 1  # at once, in the caller


def test_a_close_in_a_done_callback_is_clean_and_the_path_reopens_at_once(tmp_path):
    path = tmp_path / "s"
    store = NVMeStore(path, LAYOUT, capacity_blocks=8)
    outcome, done = [], threading.Event()

    def close_it(_):
        try:
            store.close()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001  (reported by the assertion below)
            outcome.append(exc)
        done.set()

    store.submit_put([key(0)], blocks(1, 2)).add_done_callback(close_it)
    assert done.wait(10) and outcome == [None]
    with NVMeStore(path, LAYOUT) as reopened:
        assert len(reopened) == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_fork_waits_for_a_release_in_progress():
    held = threading.Event()

    def hold():
        with nvme_lock._RELEASING:
            held.set()
            time.sleep(0.3)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    began = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    waited = time.monotonic() - began
    os.waitpid(pid, 0)
    holder.join()
    assert waited >= 0.1  # the before-fork hook took _RELEASING after the release (held for 0.3 s)


def test_nvme_store_itself_refuses_a_codec_for_heads_too_wide(tmp_path):
    assert CODEC_MAX_HEAD_DIM == 32768
    wide = KVLayout(layers=1, kv_heads=1, head_dim=CODEC_MAX_HEAD_DIM + 1, dtype="float16", block_tokens=4)
    with pytest.raises(ConfigError, match="NVMeStore: codec fp8 cannot store head_dim 32769"):
        NVMeStore(tmp_path / "s", wide, capacity_blocks=4, codec="fp8")
    with NVMeStore(tmp_path / "plain", wide, capacity_blocks=4):  # plain: any head
        pass
