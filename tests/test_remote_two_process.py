"""Acceptance of issue 11: two processes on this machine, each with its own HBM (the CPU
device here), DRAM and NVMe tiers, share one Mooncake Store (a master on loopback, stopped
by its pid)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from remote_helpers import require_mooncake
from tiercache.data.remote_master import start_master

require_mooncake()


@pytest.fixture(scope="module")
def master():
    started = start_master()
    yield started
    started.stop()


def test_two_processes_share_blocks_through_one_store(master):
    """Acceptance (issue 11): two processes, each with its own HBM/DRAM/NVMe tiers and one
    shared Mooncake Store: blocks put by one are found by the other's ``match_prefix`` and
    read bit-identical; another namespace finds nothing."""
    worker = os.path.join(os.path.dirname(__file__), "remote_worker.py")
    args = [master.master, master.metadata, "two-proc", "21", "40"]  # 40 blocks: more than the writer's local tiers
    writer = subprocess.Popen([sys.executable, worker, "put", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        wrote = json.loads(writer.stdout.readline())
        assert wrote == {"stored": 40, "published": 40}
        reader = subprocess.run([sys.executable, worker, "get", *args], capture_output=True, text=True, timeout=120)
        read = json.loads(reader.stdout.splitlines()[-1])
        assert read["found"] == 40 and read["read"] == 40 and read["identical"]
        assert read["other_namespace"] == 0
        assert read["remote"]["gets"] == 40 and read["remote"]["corrupt"] == 0
    finally:
        writer.communicate("done\n", timeout=60)
