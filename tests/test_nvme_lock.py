"""One writer per store: a second opener (another process, or this one) gets a clear error.

Issue 8, item 3: without a lock, a second process's start-up sweep deleted the first
process's chunks that were not yet in the durable index, and both appended to one journal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from tiercache.config import KVLayout
from tiercache.data.nvme import NVMeStore
from tiercache.errors import UserError

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16", per_layer=True)

OPENER = textwrap.dedent("""
    import sys, time
    from tiercache.config import KVLayout
    from tiercache.data.nvme import NVMeStore
    from tiercache.errors import UserError
    layout = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16", per_layer=True)
    try:
        store = NVMeStore(sys.argv[1], layout, 8)
    except UserError as exc:
        print("refused:", exc, flush=True)
        sys.exit(3)
    print("opened", len(store), flush=True)
    if sys.argv[2] == "hold":
        store.put([b"held"], __import__("torch").zeros((1, *layout.block_shape), dtype=__import__("torch").bfloat16))
        store.flush()
        print("holding", flush=True)
        time.sleep(120)
    store.close()
""")


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, (n, *LAYOUT.block_shape), dtype=torch.int16, generator=g).view(torch.bfloat16)


def open_elsewhere(path, mode: str = "close") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", OPENER, str(path), mode], capture_output=True, text=True, timeout=120)


def test_second_process_is_refused_naming_the_holder_and_deletes_nothing(tmp_path):
    path = tmp_path / "s"
    data = blocks(4)
    store = NVMeStore(path, LAYOUT, 8)
    store.put([b"a", b"b"], data[:2])
    store.flush()
    store.put([b"c", b"d"], data[2:])  # not yet durable: a sweep would take these chunks for garbage
    before = sorted(os.listdir(path))
    other = open_elsewhere(path)
    assert other.returncode == 3, other.stdout + other.stderr
    assert f"pid {os.getpid()}" in other.stdout and str(path) in other.stdout
    assert sorted(os.listdir(path)) == before, "the refused opener changed the store"
    store.close()
    again = open_elsewhere(path)  # the lock went with close()
    assert again.returncode == 0 and "opened 4" in again.stdout, again.stdout + again.stderr
    with NVMeStore(path, LAYOUT) as reopened:
        out = torch.empty_like(data)
        assert reopened.get([b"a", b"b", b"c", b"d"], out).all()
        assert torch.equal(out.view(torch.int16), data.view(torch.int16))


def test_second_open_in_the_same_process_is_refused(tmp_path):
    with NVMeStore(tmp_path / "s", LAYOUT, 4):
        with pytest.raises(UserError, match=f"pid {os.getpid()}"):
            NVMeStore(tmp_path / "s", LAYOUT, 4)
    NVMeStore(tmp_path / "s", LAYOUT).close()


def test_creating_a_store_takes_the_lock_first(tmp_path):
    """Two creators racing on a fresh path: the loser must not see the winner's files as a
    foreign non-empty directory, it must see the lock."""
    with NVMeStore(tmp_path / "s", LAYOUT, 4):
        other = open_elsewhere(tmp_path / "s")
    assert other.returncode == 3 and "in use" in other.stdout, other.stdout + other.stderr


def test_a_killed_holder_leaves_no_lock_behind(tmp_path):
    path = tmp_path / "s"
    NVMeStore(path, LAYOUT, 8).close()
    holder = subprocess.Popen([sys.executable, "-c", OPENER, str(path), "hold"], stdout=subprocess.PIPE, text=True)
    try:
        for line in holder.stdout:
            if line.startswith("holding"):
                break
        with pytest.raises(UserError, match=f"pid {holder.pid}"):
            NVMeStore(path, LAYOUT)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with NVMeStore(path, LAYOUT) as store:  # the kernel dropped the flock with the process
        assert store.contains(b"held")
