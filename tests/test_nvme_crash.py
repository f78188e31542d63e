"""Crash consistency: a writer process killed with SIGKILL at a random moment.

The child puts and deletes blocks in a loop on a small store (so slots are reused, both by
temp file + rename and by in-place overwrite), announcing each operation before it starts
(``p``/``d``) and confirming it only after its flush returned (``P``/``D``). After the kill, the reopened store must serve every confirmed block
bit-identical, must not hold any confirmed deletion, and whatever else it holds must be
bit-identical too: nothing torn, nothing stale. (SIGKILL keeps the kernel's page cache, so
this checks the ordering of writes, renames and index updates, not power-loss behaviour.)
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from tiercache.config import KVLayout
from tiercache.data.nvme import NVMeStore

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16", per_layer=True)

def child_script(block_tensor: str, layout: str, store_options: str = "") -> str:
    """The writer child's script: ``block(i)`` returns ``block_tensor`` (an expression of
    ``i``) as a batch of one, the store has ``layout`` (a ``KVLayout(...)`` expression) and
    ``store_options`` (extra ``NVMeStore`` keywords, e.g. ``, codec="int4"``)."""
    return textwrap.dedent("""
    import sys, torch
    from tiercache.config import KVLayout
    from tiercache.data.nvme import NVMeStore

    def block(i):
        g = torch.Generator().manual_seed(i)
        return BLOCK

    def say(kind, ids):
        sys.stdout.write(" ".join([kind, *map(str, ids)]) + "\\n")  # one write: no torn lines
        sys.stdout.flush()

    path, start, in_place = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    layout = LAYOUT
    store = NVMeStore(path, layout, 12, io_threads=2, overwrite_in_place=in_placeOPTIONS)
    live = sorted(int(k[1:]) for k, _ in store.items())
    i = start
    while True:
        if len(live) >= 10:  # keep slots cycling: delete the two oldest, durably
            gone, live = live[:2], live[2:]
            say("d", gone)
            store.delete([b"k%d" % j for j in gone])
            store.flush()
            say("D", gone)
        say("p", [i, i + 1])
        results = store.put([b"k%d" % i, b"k%d" % (i + 1)], torch.cat([block(i), block(i + 1)]))
        store.flush()
        ok = [j for j, r in zip((i, i + 1), results) if r.ok]
        live += ok
        say("P", ok)
        i += 2
    """).replace("BLOCK", block_tensor).replace("LAYOUT", layout).replace("OPTIONS", store_options)


CHILD = child_script(
    "torch.randint(-2**15, 2**15, (1, 1, 2, 2, 16, 64), dtype=torch.int16, generator=g).view(torch.bfloat16)",
    'KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16", per_layer=True)')


def block(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(-(2**15), 2**15, (1, *LAYOUT.block_shape), dtype=torch.int16, generator=g).view(torch.bfloat16)


def run_and_kill(path: str, start: int, in_place: bool, rng: random.Random, script: str = CHILD) -> list[str]:
    """Runs the writer until it confirmed something, kills it at a random moment, and
    returns every line it printed (each one a confirmed, flushed operation)."""
    child = subprocess.Popen([sys.executable, "-c", script, path, str(start), "1" if in_place else "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    first = threading.Event()

    def drain() -> None:
        for line in child.stdout:
            if line.endswith("\n"):  # a line cut by the kill confirms nothing
                lines.append(line.strip())
            first.set()

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        assert first.wait(60), f"writer confirmed nothing: {child.stderr.read() if child.poll() is not None else ''}"
        time.sleep(rng.uniform(0.2, 0.8))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        reader.join()
    assert child.returncode == -signal.SIGKILL
    return lines


def confirmed(lines: list[str]) -> tuple[set[int], set[int]]:
    """Blocks whose put was confirmed and whose deletion was never started, and blocks
    whose deletion was confirmed. A started, unconfirmed operation may or may not have
    happened: such blocks are in neither set."""
    present, deleted = set(), set()
    for line in lines:
        kind, *ids = line.split()
        ids = {int(x) for x in ids}
        if kind == "P":
            present |= ids
        elif kind == "d":
            present -= ids
        elif kind == "D":
            deleted |= ids
    return present, deleted


def check_recovered(path: str, present: set[int], deleted: set[int]) -> set[int]:
    """Reopens the store and checks it against the confirmations; returns what it holds."""
    with NVMeStore(path, LAYOUT) as store:
        store.check_invariants()
        held = {int(k[1:]) for k, _ in store.items()}
        assert present <= held, f"confirmed blocks lost: {sorted(present - held)}"
        assert not (held & deleted), f"confirmed deletions came back: {sorted(held & deleted)}"
        out = torch.empty((1, *LAYOUT.block_shape), dtype=torch.bfloat16)
        for i in sorted(held):
            assert store.get([b"k%d" % i], out)[0], f"block {i} indexed but unreadable"
            assert torch.equal(out.view(torch.int16), block(i).view(torch.int16)), f"block {i} torn"
        assert store.stats["corrupt_reads"] == 0
    return held


@pytest.mark.parametrize("in_place", [True, False], ids=["overwrite-in-place", "rename-only"])
def test_killed_writer_loses_nothing_confirmed_and_serves_nothing_torn(tmp_path, in_place):
    rng = random.Random(1234 + in_place)
    path = str(tmp_path / "store")
    lines: list[str] = []
    start = 0
    for _ in range(2):  # the second run recovers a store that was itself recovered
        lines += run_and_kill(path, start, in_place, rng)
        present, deleted = confirmed(lines)  # keys are never reused, so the runs fold in order
        held = check_recovered(path, present, deleted)
        start = max(held | present | deleted | {start}) + 2
    assert deleted, "the writer never cycled slots; the kill came too early to test reuse"


# ----- issue 8, item 6: reopen adopts only blocks whose chunk still matches its entry -----

NAMED_SLOTS_CHILD = textwrap.dedent("""
    import random, sys, torch
    from tiercache.config import KVLayout
    from tiercache.data.nvme import NVMeStore

    def block(i):
        g = torch.Generator().manual_seed(i)
        return torch.randint(-2**15, 2**15, (1, 1, 2, 2, 16, 64), dtype=torch.int16, generator=g).view(torch.bfloat16)

    path, start = sys.argv[1], int(sys.argv[2])
    layout = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16", per_layer=True)
    store = NVMeStore(path, layout, 6, io_threads=2)
    rng = random.Random(start)
    i = start
    while True:  # a manager naming slots: each put replaces whatever the slot held
        slot = rng.randrange(6)
        sys.stdout.write(f"p {i} {slot}\\n"); sys.stdout.flush()
        store.put([b"k%d" % i], block(i), slots=[slot])
        if i % 3 == 0:
            store.flush()
            sys.stdout.write("F\\n"); sys.stdout.flush()
        i += 1
""")


def durable_named(lines: list[str]) -> set[int]:
    """Blocks put, flushed afterwards, and whose slot no later put named."""
    slot_of, flushed, last_put = {}, set(), {}
    pending: list[int] = []
    for line in lines:
        kind, *rest = line.split()
        if kind == "p":
            i, slot = map(int, rest)
            slot_of[i] = slot
            last_put[slot] = i
            pending.append(i)
        else:
            flushed.update(pending)
            pending = []
    return {i for i in flushed if last_put[slot_of[i]] == i}


def test_killed_writer_naming_slots_leaves_no_stale_block_adopted(tmp_path):
    """SIGKILL while a manager rewrites live slots: every block the reopened store adopts
    must read back good on its first read; the dropped ones are crash leftovers, counted
    in ``recovered_dropped``, not corruption."""
    rng = random.Random(99)
    path = str(tmp_path / "store")
    start, dropped = 0, 0
    for _ in range(6):
        lines = run_and_kill(path, start, True, rng, NAMED_SLOTS_CHILD)
        with NVMeStore(path, LAYOUT) as store:
            held = {int(k[1:]) for k, _ in store.items()}
            assert durable_named(lines) <= held
            buf = torch.empty((1, *LAYOUT.block_shape), dtype=torch.bfloat16)
            for i in sorted(held):
                assert store.get([b"k%d" % i], buf)[0], f"block {i} adopted but unreadable"
                assert torch.equal(buf.view(torch.int16), block(i).view(torch.int16))
            assert store.stats["corrupt_reads"] == 0
            dropped += store.stats["recovered_dropped"]
        start = max(int(line.split()[1]) for line in lines if line[0] == "p") + 1
    assert dropped, "no kill landed between a slot rewrite and its flush; the test proved nothing"


class Crash(BaseException):
    """Stands for SIGKILL at a chosen point of a chunk write."""


@pytest.mark.parametrize("writes", [1, 2], ids=["after-first-write", "after-both-writes"])
def test_crash_in_a_slot_rewrite_is_dropped_at_reopen_not_served_stale(tmp_path, monkeypatch, writes):
    """A put naming a live slot overwrites its chunk in place while the old durable entry
    still names it. Whatever part of the write landed, reopen must not adopt the old entry."""
    from tiercache.data import chunkio

    old, new = block(1), block(2)
    store = NVMeStore(tmp_path / "s", LAYOUT, 1, io_threads=1)
    store.put([b"old"], old)
    store.flush()
    real, left = chunkio._pwrite_all, [writes]

    def crash_after(fd, data, offset):
        real(fd, data, offset)
        left[0] -= 1
        if left[0] == 0:
            shutil.copytree(tmp_path / "s", tmp_path / "crashed")  # the disk at the crash
            raise Crash()

    monkeypatch.setattr(chunkio, "_pwrite_all", crash_after)
    with pytest.raises(Crash):
        store.put([b"new"], new, slots=[0])
    monkeypatch.undo()
    store.close()
    with NVMeStore(tmp_path / "crashed", LAYOUT) as crashed:
        assert not crashed.contains(b"old") and len(crashed) == 0
        assert crashed.stats["recovered_dropped"] == 1 and crashed.stats["corrupt_reads"] == 0
        crashed.check_invariants()


def test_clean_close_marker_is_removed_at_open_and_only_written_by_a_clean_close(tmp_path, monkeypatch):
    """Reopen skips the trailer checks only after a clean close: the marker must be gone
    while the store is open (a kill then looks unclean) and absent after a failed close."""
    from tiercache.data.nvme_open import CLEAN_NAME

    marker = tmp_path / "s" / CLEAN_NAME
    store = NVMeStore(tmp_path / "s", LAYOUT, 2)
    store.put([b"a"], block(1))
    store.close()
    assert marker.exists()
    store = NVMeStore(tmp_path / "s", LAYOUT)
    assert not marker.exists(), "an open store must not look cleanly closed"
    store.put([b"b"], block(2))
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        store.close()
    monkeypatch.setattr(os, "pwrite", real)
    assert not marker.exists()
    marker.write_text("999\n")  # a marker from another index state proves nothing
    with open(store.chunk_path(0), "r+b") as f:  # a chunk that no longer matches its entry
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0xFF]))  # same length, other crc trailer
    with NVMeStore(tmp_path / "s", LAYOUT) as reopened:
        assert len(reopened) == 0 and reopened.stats["recovered_dropped"] == 1
