"""A forked child has none of its parent's threads: module-level thread pools it inherits
(the codecs' head-splitting pool, the host copier) must not be used there, or its first
quantised encode or pool copy waits forever for a thread that does not exist."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tiercache.data import codec_base, pools
from tiercache.data.codecs import codec_for

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _child_finishes(work, seconds: float = 20.0) -> bool:
    """Runs ``work`` in a forked child; True when it exits 0 within ``seconds``."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            work()
            os._exit(0)
        except BaseException:  # noqa: BLE001 - any failure is a nonzero exit
            os._exit(1)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def test_a_forked_child_encodes_after_its_parent_did():
    block = torch.randn(1, 2, 4, 16, 64).half()  # 4 heads: split over the codec pool
    codec = codec_for("int4")
    codec.encode(block)
    if codec_base._CPUS >= 2:
        assert codec_base._POOL is not None  # the parent's pool exists, with its thread
    assert _child_finishes(lambda: codec.decode(codec.encode(block), torch.empty_like(block)))


def test_a_forked_child_gets_its_own_host_copier():
    pools._host_copier = pools.ThreadPoolExecutor(1, "tiercache-copy")  # as after a parent's big copy
    pools._host_copier.submit(lambda: None).result()

    def child() -> None:
        assert pools._host_copier is None  # a fresh pool is made at the child's first copy

    assert _child_finishes(child)
