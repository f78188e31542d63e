"""Shared pieces of the remote-tier tests: skipping without Mooncake, a master on loopback,
stores wired to it."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import pytest

from store_helpers import LAYOUT
from tiercache.config import KVLayout, RemoteConfig, RemoteWrite, TierConfig

SKIP_REASON = ("Mooncake Store is not installed (pip install -e '.[remote]', and apt-get install libibverbs1 "
               "libnuma1): the remote tier's tests need it; CI installs both")


def require_mooncake() -> None:
    """Skips the calling module, saying why, when ``mooncake.store`` cannot be imported."""
    pytest.importorskip("mooncake.store", reason=SKIP_REASON)


def remote_config(master, write: RemoteWrite = RemoteWrite.THROUGH, segment_mib: int = 16, **options) -> RemoteConfig:
    """A client config for a ``MasterProcess`` (small segments: tests run many clients)."""
    return RemoteConfig(master.master, master.metadata, segment_bytes=segment_mib << 20, buffer_bytes=8 << 20,
                        write=write, **options)


def remote_tiers(config: RemoteConfig, hbm: int = 2, dram: int = 3, nvme: int = 8, remote: int = 256) -> list[TierConfig]:
    """hbm, dram, nvme and the remote tier."""
    tiers = [TierConfig("hbm", hbm), TierConfig("dram", dram)]
    if nvme:
        tiers.append(TierConfig("nvme", nvme))
    return tiers + [TierConfig("remote", remote, remote=config)]


def open_store(config: RemoteConfig, layout: KVLayout = LAYOUT, **sizes):
    """A TieredKVStore (CPU device) with local tiers and the remote tier."""
    from tiercache.live.store import TieredKVStore

    tiers = remote_tiers(config, **sizes)
    path = tempfile.mkdtemp(prefix="tiercache-remote-") if any(t.name == "nvme" for t in tiers) else None
    return TieredKVStore(layout, tiers, path=path, device="cpu")


@pytest.fixture(scope="module")
def master():
    """A Mooncake master on loopback for one test module, stopped by its pid afterwards (a
    module imports this fixture by name)."""
    from tiercache.data.remote_master import start_master

    started = start_master()
    yield started
    started.stop()


def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """Stops process ``pid`` (SIGSTOP) and returns once every one of its threads is stopped.

    ``kill`` only queues the signal: on a loaded machine the master's threads can run on (and
    answer a call) for a while after it returns, so a test that means "the master hangs" waits
    here until /proc shows each thread in state T. Raises AssertionError past ``timeout_s``."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not _all_threads_stopped(pid):
        assert time.monotonic() < deadline, f"process {pid} did not stop within {timeout_s} s of SIGSTOP"
        time.sleep(0.001)


def _all_threads_stopped(pid: int) -> bool:
    """True when every thread of ``pid`` is in state T (stopped) or t (traced)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that exited meanwhile
            continue
    return all(state in "Tt" for state in states)
