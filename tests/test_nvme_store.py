"""NVMeStore: round trips, zarr compatibility both ways, capacity, bad input, threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import zarr

from conftest import run_threads
from tiercache.config import KVLayout
from tiercache.data import chunkio, nvme_index
from tiercache.data.buffers import torch_dtype
from tiercache.data.nvme import NVMeStore, StoreFullError
from tiercache.data.pools import dram_pool
from tiercache.errors import UserError

# 16 KiB blocks (page multiple: O_DIRECT straight into the destination) and 6 KiB blocks
# (not a page multiple: the staged read path).
LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16", per_layer=True)
ODD = KVLayout(layers=2, kv_heads=2, head_dim=24, block_tokens=16, dtype="float16", per_layer=True)


def blocks_for(layout: KVLayout, n: int, seed: int = 0) -> torch.Tensor:
    """Random bit patterns of the layout's dtype (NaNs included: compare with ``bits``)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-(2**15), 2**15, (n, *layout.block_shape), dtype=torch.int16, generator=g)
    return raw.view(torch_dtype(layout.dtype))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def keys_for(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


@pytest.mark.parametrize("layout", [LAYOUT, ODD], ids=["bf16-aligned", "fp16-staged"])
@pytest.mark.parametrize("compression", [None, "lz4"])
def test_round_trip_is_bit_identical(tmp_path, layout, compression):
    data = blocks_for(layout, 6, seed=1)
    with NVMeStore(tmp_path / "s", layout, 8, compression=compression) as store:
        results = store.put(keys_for(6), data)
        assert all(r.ok for r in results) and sorted(r.slot for r in results) == list(range(6))
        out = torch.empty_like(data)
        assert store.get(keys_for(6), out).all()
        assert torch.equal(bits(out), bits(data))
        pool = dram_pool(layout, 6)  # list-of-views destination, in another order
        hits = store.get(keys_for(6)[::-1], [pool.view(i) for i in range(6)])
        assert hits.all() and torch.equal(bits(pool.tensor), bits(data.flip(0)))
        store.check_invariants()


def test_reopen_in_a_new_process_serves_every_block(tmp_path):
    data = blocks_for(LAYOUT, 5, seed=2)
    with NVMeStore(tmp_path / "s", LAYOUT, 8) as store:
        store.put(keys_for(5), data)
    np.save(tmp_path / "expected.npy", bits(data).numpy())
    script = textwrap.dedent(f"""
        import numpy as np, torch
        from tiercache.config import KVLayout
        from tiercache.data.nvme import NVMeStore
        layout = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16", per_layer=True)
        expected = np.load({str(tmp_path / "expected.npy")!r})
        with NVMeStore({str(tmp_path / "s")!r}, layout, create=False) as store:
            assert sorted(store.items()) == [(b"k%d" % i, i) for i in range(5)], store.items()
            out = torch.empty((5, *layout.block_shape), dtype=torch.bfloat16)
            hits = store.get([b"k%d" % i for i in range(5)], out)
            assert hits.all(), hits
            assert np.array_equal(out.view(torch.int16).numpy(), expected)
            assert len(store) == 5 and store.stats["garbage_removed"] == 0
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("compression", [None, "lz4"])
def test_zarr_reads_what_the_direct_path_wrote(tmp_path, compression):
    data = blocks_for(LAYOUT, 4, seed=3)
    with NVMeStore(tmp_path / "s", LAYOUT, 6, compression=compression) as store:
        slots = [r.slot for r in store.put(keys_for(4), data)]
    array = zarr.open_array(str(tmp_path / "s"), mode="r")
    assert array.shape == (6, *LAYOUT.block_shape) and array.dtype == np.uint16
    assert array.attrs["tiercache"]["layout"]["dtype"] == "bfloat16"
    for i, slot in enumerate(slots):
        assert np.array_equal(array[slot], data[i].view(torch.uint16).numpy())
    free = next(s for s in range(6) if s not in slots)
    assert not array[free].any(), "a slot never written reads as the fill value"


@pytest.mark.parametrize("compression", [None, "lz4"])
def test_direct_path_reads_what_zarr_wrote(tmp_path, compression):
    with NVMeStore(tmp_path / "s", LAYOUT, 4, compression=compression):
        pass
    data = blocks_for(LAYOUT, 1, seed=4)
    array = zarr.open_array(str(tmp_path / "s"), mode="r+")
    array[2:3] = data.view(torch.uint16).numpy()
    codec = chunkio.ChunkCodec(LAYOUT.block_bytes, compression, 2)
    buffer = np.zeros(LAYOUT.block_bytes + 4096, dtype=np.uint8)
    n, _ = chunkio.read_chunk_file(str(tmp_path / "s" / chunkio.chunk_name(2, 6)), [buffer], False)
    chunk = buffer[:n]
    assert codec.check(chunk) is not None, "zarr's crc32c trailer verifies with the direct path"
    out = torch.empty(LAYOUT.block_shape, dtype=torch.bfloat16)
    assert codec.decode_into(chunk, out.view(-1).view(torch.uint8).numpy())
    assert torch.equal(bits(out), bits(data[0]))


def test_capacity_is_enforced_and_never_grows(tmp_path):
    with NVMeStore(tmp_path / "s", LAYOUT, 3) as store:
        store.put(keys_for(3), blocks_for(LAYOUT, 3))
        with pytest.raises(StoreFullError, match="store full: 1 blocks to put, 0 of 3 slots free"):
            store.put([b"extra"], blocks_for(LAYOUT, 1))
        assert len(store) == 3 and not store.contains(b"extra")
        store.delete([b"k0"])
        with pytest.raises(StoreFullError, match="1 more after the next flush"):
            store.put([b"extra"], blocks_for(LAYOUT, 1))
        store.flush()
        assert store.put([b"extra"], blocks_for(LAYOUT, 1))[0].ok
    assert zarr.open_array(str(tmp_path / "s"), mode="r").shape[0] == 3
    assert sorted(n for n in os.listdir(tmp_path / "s") if n.startswith("c.")) == [chunkio.chunk_name(s, 6) for s in range(3)]


def test_put_replaces_a_key_and_retires_its_old_slot(tmp_path):
    first, second = blocks_for(LAYOUT, 1, seed=5), blocks_for(LAYOUT, 1, seed=6)
    with NVMeStore(tmp_path / "s", LAYOUT, 2) as store:
        old = store.put([b"a"], first)[0].slot
        new = store.put([b"a"], second)[0].slot
        assert new != old and store.slot_of(b"a") == new and store.free_blocks == 0
        store.flush()
        assert store.free_blocks == 1
        out = torch.empty_like(second)
        assert store.get([b"a"], out).all() and torch.equal(bits(out), bits(second))
        store.check_invariants()


def test_put_into_named_slots(tmp_path):
    data = blocks_for(LAYOUT, 3, seed=7)
    with NVMeStore(tmp_path / "s", LAYOUT, 4) as store:
        assert [r.slot for r in store.put(keys_for(2), data[:2], slots=[3, 1])] == [3, 1]
        store.flush()
        store.put([b"c"], data[2:], slots=[3])  # takes the slot of k0, which is dropped
        assert not store.contains(b"k0") and store.slot_of(b"c") == 3
        with pytest.raises(UserError, match="outside"):
            store.put([b"d"], data[:1], slots=[4])
        with pytest.raises(UserError, match="2 keys but 1 slots"):
            store.put([b"d", b"e"], data[:2], slots=[0])
        store.check_invariants()
    with NVMeStore(tmp_path / "s", LAYOUT) as store:
        out = torch.empty_like(data[:1])
        assert store.get([b"c"], out).all() and torch.equal(bits(out), bits(data[2:]))
        assert store.contains(b"k1") and not store.contains(b"k0")


@pytest.mark.parametrize("in_place", [True, False])
def test_reused_slot_overwrites_in_place_or_renames(tmp_path, in_place):
    with NVMeStore(tmp_path / "s", LAYOUT, 1, overwrite_in_place=in_place) as store:
        store.put([b"a"], blocks_for(LAYOUT, 1, seed=8))
        inode = os.stat(store.chunk_path(0)).st_ino
        store.delete([b"a"])
        store.flush()
        data = blocks_for(LAYOUT, 1, seed=9)
        store.put([b"b"], data)
        assert (os.stat(store.chunk_path(0)).st_ino == inode) == in_place
        out = torch.empty_like(data)
        assert store.get([b"b"], out).all() and torch.equal(bits(out), bits(data))


def test_delete_contains_len_and_misses(tmp_path):
    with NVMeStore(tmp_path / "s", LAYOUT, 4) as store:
        store.put(keys_for(3), blocks_for(LAYOUT, 3))
        assert store.delete([b"k1", b"absent"]) == 1
        assert len(store) == 2 and not store.contains(b"k1") and store.contains(b"k2")
        out = torch.ones((2, *LAYOUT.block_shape), dtype=torch.bfloat16)
        assert store.get([b"k1", b"k2"], out).tolist() == [False, True]
        assert store.stats["misses"] == 1 and store.stats["hits"] == 1


def test_journal_compacts_into_a_snapshot_and_reopens(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme_index, "_JOURNAL_MIN_BYTES", 200)
    data = blocks_for(LAYOUT, 12, seed=10)
    with NVMeStore(tmp_path / "s", LAYOUT, 12) as store:
        for i in range(12):  # one flush per block: the journal outgrows 200 bytes quickly
            store.put([b"k%d" % i], data[i : i + 1])
            store.flush()
        store.delete([b"k0", b"k5"])
    assert os.path.getsize(tmp_path / "s" / nvme_index.JOURNAL_NAME) < 400
    with NVMeStore(tmp_path / "s", LAYOUT) as store:
        assert len(store) == 10 and not store.contains(b"k0")
        out = torch.empty_like(data[1:5])
        assert store.get(keys_for(5)[1:], out).all() and torch.equal(bits(out), bits(data[1:5]))


def test_bad_paths_and_mismatches_raise_user_errors(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        NVMeStore(tmp_path / "file", LAYOUT, 4)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "other.txt").write_text("x")
    with pytest.raises(UserError, match="not empty and holds no tiercache store"):
        NVMeStore(tmp_path / "busy", LAYOUT, 4)
    with pytest.raises(UserError, match="no store there"):
        NVMeStore(tmp_path / "missing", LAYOUT, 4, create=False)
    with pytest.raises(UserError, match="capacity_blocks is needed"):
        NVMeStore(tmp_path / "new", LAYOUT)
    NVMeStore(tmp_path / "s", LAYOUT, 4).close()
    with pytest.raises(UserError, match="store holds layout"):
        NVMeStore(tmp_path / "s", ODD, 4)
    with pytest.raises(UserError, match="store capacity is 4 blocks, asked for 5"):
        NVMeStore(tmp_path / "s", LAYOUT, 5)
    with pytest.raises(UserError, match="store compression is None, asked for 'lz4'"):
        NVMeStore(tmp_path / "s", LAYOUT, 4, compression="lz4")
    with pytest.raises(UserError, match="compression must be None or 'lz4'"):
        NVMeStore(tmp_path / "t", LAYOUT, 4, compression="zstd")


@pytest.mark.parametrize("capacity", [0, "1KiB", -3])
def test_capacity_below_one_block_is_refused(tmp_path, capacity):
    with pytest.raises(UserError, match="at least one block|less than one block|must be positive|cannot parse"):
        NVMeStore(tmp_path / "s", LAYOUT, capacity)
    assert not (tmp_path / "s").exists(), "nothing is created for a refused store"


def test_capacity_as_a_size(tmp_path):
    with NVMeStore(tmp_path / "s", LAYOUT, "64KiB") as store:
        assert store.capacity == 64 * 1024 // LAYOUT.block_bytes


@pytest.mark.parametrize(
    "keys, blocks, message",
    [
        (["k0"], None, "keys must be bytes, got str"),
        ([bytearray(b"k0")], None, "keys must be bytes, got bytearray"),
        ([7], None, "keys must be bytes, got int"),
        (b"k0", None, "keys must be a list of bytes"),
        ([b""], None, "key length must be 1..65535"),
        ([b"a", b"a"], "two", "a key appears twice"),
        ([b"a"], "fp16", "expected dtype bfloat16, got float16"),
        ([b"a"], "shape", r"expected shape \[1, 1, 2, 2, 16, 64\], got \[1, 1, 2, 2, 8, 64\]"),
        ([b"a", b"b"], None, r"expected shape \[2, "),
    ],
)
def test_bad_puts_raise_user_errors_and_write_nothing(tmp_path, keys, blocks, message):
    tensors = {
        None: blocks_for(LAYOUT, 1),
        "two": blocks_for(LAYOUT, 2),
        "fp16": torch.zeros((1, *LAYOUT.block_shape), dtype=torch.float16),
        "shape": torch.zeros((1, 1, 2, 2, 8, 64), dtype=torch.bfloat16),
    }
    with NVMeStore(tmp_path / "s", LAYOUT, 4) as store:
        with pytest.raises(UserError, match=message):
            store.put(keys, tensors[blocks])
        assert len(store) == 0 and store.free_blocks == 4
        assert not [n for n in os.listdir(tmp_path / "s") if n.startswith(("c.", ".tc-tmp"))]
        with pytest.raises(UserError, match="keys must be bytes"):
            store.contains("k0")
        with pytest.raises(UserError, match="expected dtype bfloat16"):
            store.get([b"a"], torch.zeros((1, *LAYOUT.block_shape), dtype=torch.float32))


def test_closed_store_refuses_work(tmp_path):
    store = NVMeStore(tmp_path / "s", LAYOUT, 2)
    store.close()
    store.close()  # idempotent
    with pytest.raises(UserError, match="store is closed"):
        store.put([b"a"], blocks_for(LAYOUT, 1))


def test_concurrent_puts_gets_and_deletes_stay_consistent(tmp_path):
    """Four threads for ~1.5 s on shared and private keys. A key's content is a function of
    the key, so any hit of any thread must be bit-identical to it."""
    shared = [b"shared-%d" % i for i in range(6)]
    content = {k: blocks_for(LAYOUT, 1, seed=int.from_bytes(k, "little") % 2**31) for k in shared}
    errors: list[str] = []
    store = NVMeStore(tmp_path / "s", LAYOUT, 40, io_threads=3)
    deadline = time.monotonic() + 1.5

    def worker(tid: int) -> None:
        rng = np.random.default_rng(tid)
        mine = [b"t%d-%d" % (tid, i) for i in range(4)]
        local = {k: blocks_for(LAYOUT, 1, seed=1000 * tid + i) for i, k in enumerate(mine)}
        out = torch.empty((1, *LAYOUT.block_shape), dtype=torch.bfloat16)
        while time.monotonic() < deadline:
            key = shared[rng.integers(6)] if rng.random() < 0.5 else mine[rng.integers(4)]
            data = content.get(key, local.get(key))
            action = rng.random()
            try:
                if action < 0.4:
                    store.put([key], data)
                elif action < 0.85:
                    if store.get([key], out)[0] and not torch.equal(bits(out), bits(data)):
                        errors.append(f"thread {tid}: wrong bytes for {key!r}")
                elif action < 0.95:
                    store.delete([key])
                else:
                    store.flush()
            except StoreFullError:
                store.flush()  # retired slots come back after a flush

    run_threads(worker, 4, timeout=30)
    assert not errors, errors[:3]
    store.check_invariants()
    live = [k for k in shared if store.contains(k)]
    store.close()
    with NVMeStore(tmp_path / "s", LAYOUT) as reopened:
        out = torch.empty((1, *LAYOUT.block_shape), dtype=torch.bfloat16)
        for key in live:
            assert reopened.get([key], out)[0] and torch.equal(bits(out), bits(content[key]))
        reopened.check_invariants()


def test_store_metadata_is_plain_zarr_json(tmp_path):
    NVMeStore(tmp_path / "s", LAYOUT, 2, compression="lz4").close()
    meta = json.loads((tmp_path / "s" / "zarr.json").read_text())
    assert meta["zarr_format"] == 3 and meta["chunk_grid"]["configuration"]["chunk_shape"] == [1, *LAYOUT.block_shape]
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "blosc", "crc32c"]
    assert meta["codecs"][1]["configuration"]["cname"] == "lz4"
    assert meta["chunk_key_encoding"] == {"name": "default", "configuration": {"separator": "."}}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_blocks_go_through_host_staging(tmp_path):
    data = blocks_for(LAYOUT, 3, seed=11)
    with NVMeStore(tmp_path / "s", LAYOUT, 4) as store:
        assert all(r.ok for r in store.put(keys_for(3), data.cuda()))
        out = torch.empty((3, *LAYOUT.block_shape), dtype=torch.bfloat16, device="cuda")
        assert store.get(keys_for(3), out).all()
        assert torch.equal(bits(out.cpu()), bits(data))


@pytest.mark.parametrize("slot", [1.5, True, "x", None])
def test_put_refuses_slots_that_are_not_integers(tmp_path, slot):
    """``slots=[1.5]`` and ``[True]`` wrote slot 1 by silent conversion; ``["x"]`` raised a raw
    ValueError from ``int``."""
    block = torch.zeros((1, *LAYOUT.block_shape), dtype=torch.bfloat16)
    with NVMeStore(tmp_path / "s", LAYOUT, 4) as store:
        with pytest.raises(UserError, match="slots must be integers"):
            store.put([b"k"], block, slots=[slot])
        assert len(store) == 0
        store.put([b"k"], block, slots=[np.int64(2)])
        assert store.slot_of(b"k") == 2


def test_a_store_dropped_without_close_releases_its_path_and_threads(tmp_path):
    """A caller's bug, not a crash: the dropped store warns, its I/O threads stop and its lock
    goes, so the path reopens in this process with what the last flush made durable (its
    idle I/O threads used to keep it alive, holding the lock: "store in use by this process")."""
    import gc
    import threading
    import warnings

    block = torch.ones((1, *LAYOUT.block_shape), dtype=torch.bfloat16)
    store = NVMeStore(tmp_path / "s", LAYOUT, 4)
    store.put([b"kept"], block)
    store.flush()
    store.put([b"not flushed"], block)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del store
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)
    for _ in range(50):
        if not any(t.name.startswith("tiercache-nvme") for t in threading.enumerate()):
            break
        time.sleep(0.02)
    assert not any(t.name.startswith("tiercache-nvme") for t in threading.enumerate())
    with NVMeStore(tmp_path / "s", LAYOUT) as reopened:
        assert reopened.slot_of(b"kept") is not None
