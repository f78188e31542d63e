"""NVMeStore under faults: failing writes and flushes, corrupt chunks, damaged index files."""

from __future__ import annotations

import errno
import os
import re
import shutil

import pytest
import torch
import zarr

from tiercache.config import KVLayout
from tiercache.data import nvme_index
from tiercache.data.nvme import NVMeStore
from tiercache.data.nvme_results import ReadIOError
from tiercache.errors import UserError

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16", per_layer=True)
ODD = KVLayout(layers=2, kv_heads=2, head_dim=24, block_tokens=16, dtype="float16", per_layer=True)


def blocks_for(layout: KVLayout, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-(2**15), 2**15, (n, *layout.block_shape), dtype=torch.int16, generator=g)
    return raw.view(torch.bfloat16 if layout.dtype == "bfloat16" else torch.float16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def fail_next(monkeypatch, name: str, count: int = 1, code: int = errno.ENOSPC) -> list[int]:
    """Makes the next ``count`` calls of ``os.<name>`` raise OSError(code); later calls pass."""
    real = getattr(os, name)
    left = [count]

    def fake(*args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, fake)
    return left


def leftovers(path) -> list[str]:
    return [n for n in os.listdir(path) if n.startswith(".tc-tmp") or n.endswith(".tmp")]


def assert_serves(store: NVMeStore, keys: list[bytes], data: torch.Tensor) -> None:
    out = torch.empty_like(data)
    hits = store.get(keys, out)
    assert hits.all(), hits
    assert torch.equal(bits(out), bits(data))


@pytest.mark.parametrize("fault", ["pwrite", "fdatasync", "replace"])
def test_failed_new_chunk_write_is_absent_and_the_store_stays_consistent(tmp_path, monkeypatch, fault):
    data = blocks_for(LAYOUT, 3, seed=1)
    store = NVMeStore(tmp_path / "s", LAYOUT, 4, io_threads=1)  # one thread: the first write fails
    armed = fail_next(monkeypatch, fault)
    results = store.put([b"a", b"b", b"c"], data)
    monkeypatch.undo()
    assert armed == [0]
    assert results[0].slot is None and results[0].error.errno == errno.ENOSPC and not results[0].ok
    assert results[1].ok and results[2].ok
    assert store.stats["failed_writes"] == 1 and not store.contains(b"a")
    assert store.free_blocks == 2 and not leftovers(tmp_path / "s")
    store.check_invariants()
    store.close()
    with NVMeStore(tmp_path / "s", LAYOUT) as reopened:
        assert sorted(k for k, _ in reopened.items()) == [b"b", b"c"]
        assert_serves(reopened, [b"b", b"c"], data[1:])
        assert reopened.put([b"a"], data[:1])[0].ok


@pytest.mark.parametrize("fault", ["pwrite", "fdatasync"])
def test_failed_in_place_overwrite_is_absent(tmp_path, monkeypatch, fault):
    data = blocks_for(LAYOUT, 2, seed=2)
    with NVMeStore(tmp_path / "s", LAYOUT, 1, io_threads=1) as store:
        store.put([b"old"], data[:1])
        store.delete([b"old"])
        store.flush()  # slot 0 is free again and its chunk file stays: the next put overwrites it
        fail_next(monkeypatch, fault, count=2)  # the overwrite, and its retry once the old file is reclaimed
        result = store.put([b"new"], data[1:])[0]
        monkeypatch.undo()
        assert result.error is not None and not store.contains(b"new") and store.free_blocks == 1
        store.check_invariants()
        assert store.put([b"new"], data[1:])[0].ok
        assert_serves(store, [b"new"], data[1:])


def test_failed_flush_keeps_the_batch_pending_and_nothing_half_durable(tmp_path, monkeypatch):
    data = blocks_for(LAYOUT, 3, seed=3)
    store = NVMeStore(tmp_path / "s", LAYOUT, 4)
    store.put([b"a"], data[:1])
    store.flush()
    store.put([b"b", b"c"], data[1:])
    fail_next(monkeypatch, "pwrite")  # the journal append
    with pytest.raises(OSError, match="No space left"):
        store.flush()
    monkeypatch.undo()
    assert store.stats["failed_flushes"] == 1
    assert_serves(store, [b"b", b"c"], data[1:])  # still served in this process
    shutil.copytree(tmp_path / "s", tmp_path / "crashed")  # what a crash now would leave
    with NVMeStore(tmp_path / "crashed", LAYOUT) as crashed:
        assert [k for k, _ in crashed.items()] == [b"a"], "b and c never became durable"
        assert crashed.stats["garbage_removed"] == 2  # their chunk files are garbage
        assert_serves(crashed, [b"a"], data[:1])
    store.flush()  # the retry writes a fresh snapshot (the journal may hold a torn tail)
    store.close()
    with NVMeStore(tmp_path / "s", LAYOUT) as reopened:
        assert_serves(reopened, [b"a", b"b", b"c"], data)


@pytest.mark.parametrize("layout", [LAYOUT, ODD], ids=["in-place-read", "staged-read"])
@pytest.mark.parametrize("damage", ["flip-data", "flip-crc", "truncate"])
def test_corrupt_chunk_is_a_counted_miss_never_data(tmp_path, layout, damage):
    data = blocks_for(layout, 2, seed=4)
    with NVMeStore(tmp_path / "s", layout, 2) as store:
        slot = store.put([b"a", b"b"], data)[0].slot
        path = store.chunk_path(slot)
        raw = bytearray(open(path, "rb").read())
        if damage == "flip-data":
            raw[len(raw) // 2] ^= 0x40
        elif damage == "flip-crc":
            raw[-1] ^= 0x01
        else:
            raw = raw[:-100]
        with open(path, "r+b") as f:
            f.truncate(0)
            f.write(raw)
        out = torch.ones((2, *layout.block_shape), dtype=data.dtype)
        assert store.get([b"a", b"b"], out).tolist() == [False, True]
        assert store.stats["corrupt_reads"] == 1
        assert not bits(out[0]).any(), "the damaged block's destination is zeroed, not left looking like data"
        assert torch.equal(bits(out[1]), bits(data[1]))
        assert not store.contains(b"a"), "a corrupt block is forgotten so the manager recomputes it"
        store.check_invariants()


def test_compressed_corrupt_chunk_is_a_miss(tmp_path):
    data = blocks_for(LAYOUT, 1, seed=5)
    with NVMeStore(tmp_path / "s", LAYOUT, 1, compression="lz4") as store:
        store.put([b"a"], data)
        with open(store.chunk_path(0), "r+b") as f:
            f.seek(40)
            byte = f.read(1)
            f.seek(40)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert not store.get([b"a"], torch.empty_like(data))[0]
        assert store.stats["corrupt_reads"] == 1
    with pytest.raises(Exception, match="checksum"):
        zarr.open_array(str(tmp_path / "s"), mode="r")[0]  # zarr itself refuses the chunk too


def test_stale_durable_entry_never_serves_newer_bytes(tmp_path):
    """A put that names a live slot rewrites it in place before the old key's removal is
    durable. After a crash, reopen sees the chunk's trailer no longer matches the old
    entry and drops it (a crash leftover, not corruption). If the trailer still matched
    (power loss may persist the old trailer with new payload pages), the read's full crc
    check turns the bytes into a counted miss."""
    data = blocks_for(LAYOUT, 2, seed=6)
    with NVMeStore(tmp_path / "s", LAYOUT, 1) as store:
        store.put([b"old"], data[:1])
        store.flush()
        old_trailer = open(store.chunk_path(0), "rb").read()[-4:]
        store.put([b"new"], data[1:], slots=[0])  # not flushed
        shutil.copytree(tmp_path / "s", tmp_path / "crashed")
        shutil.copytree(tmp_path / "s", tmp_path / "torn")
    with NVMeStore(tmp_path / "crashed", LAYOUT) as crashed:
        assert not crashed.contains(b"old") and not crashed.contains(b"new")
        assert crashed.stats["recovered_dropped"] == 1 and crashed.stats["corrupt_reads"] == 0
        crashed.check_invariants()
    with open(tmp_path / "torn" / os.path.basename(store.chunk_path(0)), "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(old_trailer)
    with NVMeStore(tmp_path / "torn", LAYOUT) as torn:
        assert torn.contains(b"old")
        assert not torn.get([b"old"], torch.empty_like(data[:1]))[0]
        assert torn.stats["corrupt_reads"] == 1 and not torn.contains(b"old")
        torn.check_invariants()


def test_torn_journal_tail_is_ignored_and_cut(tmp_path):
    data = blocks_for(LAYOUT, 3, seed=7)
    with NVMeStore(tmp_path / "s", LAYOUT, 4) as store:
        for i in range(3):
            store.put([b"k%d" % i], data[i : i + 1])
            store.flush()
    journal = tmp_path / "s" / nvme_index.JOURNAL_NAME
    good = journal.stat().st_size
    with open(journal, "ab") as f:
        f.write(b"TCJ1" + os.urandom(37))  # a batch header whose body never made it
    with NVMeStore(tmp_path / "s", LAYOUT) as store:
        assert journal.stat().st_size == good
        assert_serves(store, [b"k0", b"k1", b"k2"], data)
        store.put([b"k3"], data[:1])
    with NVMeStore(tmp_path / "s", LAYOUT) as store:
        assert len(store) == 4


def test_damaged_snapshot_is_a_user_error(tmp_path):
    NVMeStore(tmp_path / "s", LAYOUT, 2).close()
    snapshot = tmp_path / "s" / nvme_index.SNAPSHOT_NAME
    raw = bytearray(snapshot.read_bytes())
    raw[5] ^= 0xFF
    snapshot.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="index snapshot damaged"):
        NVMeStore(tmp_path / "s", LAYOUT)


def test_reopen_sweeps_orphans_and_forgets_missing_chunks(tmp_path):
    data = blocks_for(LAYOUT, 2, seed=8)
    with NVMeStore(tmp_path / "s", LAYOUT, 4) as store:
        store.put([b"a", b"b"], data)
        missing = store.chunk_path(store.slot_of(b"b"))
        orphan = store.chunk_path(3)
    os.unlink(missing)
    shutil.copy(store.chunk_path(0), orphan)  # a chunk no index entry names
    (tmp_path / "s" / ".tc-tmp.2.99").write_bytes(b"partial")
    with NVMeStore(tmp_path / "s", LAYOUT) as store:
        assert store.stats["garbage_removed"] == 2 and store.stats["recovered_dropped"] == 1
        assert [k for k, _ in store.items()] == [b"a"] and store.free_blocks == 3
        assert not os.path.exists(orphan) and not leftovers(tmp_path / "s")
        store.check_invariants()
    with NVMeStore(tmp_path / "s", LAYOUT) as store:  # the drop was made durable
        assert store.stats["recovered_dropped"] == 0 and len(store) == 1
        assert_serves(store, [b"a"], data[:1])


def test_read_error_keeps_the_block_and_names_the_error(tmp_path, monkeypatch):
    data = blocks_for(LAYOUT, 1, seed=9)
    with NVMeStore(tmp_path / "s", LAYOUT, 1, io_threads=1) as store:
        store.put([b"a"], data)
        fail_next(monkeypatch, "preadv", code=errno.EIO)
        with pytest.raises(ReadIOError, match=f"{b'a'.hex()} failed: Input/output error") as caught:
            store.get([b"a"], torch.empty_like(data))
        assert caught.value.errno == errno.EIO
        monkeypatch.undo()
        assert store.stats["read_errors"] == 1 and store.stats["corrupt_reads"] == 0 and store.contains(b"a")
        assert_serves(store, [b"a"], data)


def files_open_under(path) -> list[str]:
    """Paths under ``path`` that this process holds open."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the fd of the listing itself is gone already
        if target.startswith(str(path)):
            held.append(target)
    return held


def test_full_disk_close_names_the_store_closes_every_file_and_reopens(tmp_path, monkeypatch):
    """Issue 8, item 7 (store part): failed writes are counted, a close that cannot flush
    raises an error naming the store after releasing every file, and what was durable
    before reopens."""
    data = blocks_for(LAYOUT, 5, seed=10)
    store = NVMeStore(tmp_path / "s", LAYOUT, 8, io_threads=1)
    store.put([b"a", b"b"], data[:2])
    store.flush()
    fail_next(monkeypatch, "pwrite", count=2)  # the disk is full for the next two chunk writes
    results = store.put([b"c", b"d", b"e"], data[2:])
    monkeypatch.undo()
    assert [r.ok for r in results] == [False, False, True] and store.stats["failed_writes"] == 2
    fail_next(monkeypatch, "pwrite", count=100)  # still full at close: the journal append fails
    with pytest.raises(OSError, match=re.escape(str(tmp_path / "s"))) as caught:
        store.close()
    monkeypatch.undo()
    assert caught.value.errno == errno.ENOSPC and "not durable" in str(caught.value)
    assert files_open_under(tmp_path / "s") == [], "close left files open"
    store.close()  # idempotent, raises nothing the second time
    with NVMeStore(tmp_path / "s", LAYOUT) as reopened:
        assert sorted(k for k, _ in reopened.items()) == [b"a", b"b"]
        assert_serves(reopened, [b"a", b"b"], data[:2])
