"""Quantised tiers (issue 10 part 3): a DRAM ``QuantizedPool`` and an NVMe store with a codec,
inside a ``TieredKVStore``: blocks round-trip within the codec's bound from every tier and
after reopening, are quantised once however often they move, the store records its codec
and refuses another, and capacity follows the codec's real bytes per block.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
zarr = pytest.importorskip("zarr")

from tiercache import TieredKVStore  # noqa: E402
from tiercache.config import Codec, KVLayout, TierConfig, parse_capacity  # noqa: E402
from tiercache.data.codecs import codec_for  # noqa: E402
from tiercache.data.nvme import NVMeStore  # noqa: E402
from tiercache.data.quantized import QuantizedPool  # noqa: E402
from tiercache.errors import UserError  # noqa: E402

from store_helpers import key  # noqa: E402
from test_codecs import ROUND_TRIP_BOUND, rel_err, synthetic_block  # noqa: E402

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=64, dtype="float16", block_tokens=64)


def kv_blocks(n: int) -> torch.Tensor:
    """``n`` fresh synthetic fp16 blocks of ``LAYOUT`` (outlier key channels)."""
    return torch.stack([synthetic_block(LAYOUT.layers, LAYOUT.kv_heads, LAYOUT.block_tokens, LAYOUT.head_dim)
                        for _ in range(n)])


def once(codec: Codec, block: torch.Tensor) -> torch.Tensor:
    """``block`` quantised and dequantised once."""
    impl = codec_for(codec)
    return impl.decode(impl.encode(block), torch.empty_like(block))


def tiers(dram_codec: Codec, nvme_codec: Codec, nvme: int = 64) -> list[TierConfig]:
    return [TierConfig("hbm", 3), TierConfig("dram", 4, codec=dram_codec), TierConfig("nvme", nvme, codec=nvme_codec)]


def assert_within(codec: Codec, got: torch.Tensor, block: torch.Tensor) -> None:
    for half in (0, 1):
        assert rel_err(got[:, half], block[:, half]) <= ROUND_TRIP_BOUND[codec]


def where(store: TieredKVStore, keys: list[bytes]) -> list[str | None]:
    return store.lookup(keys)[1]


@pytest.mark.parametrize("dram_codec", [Codec.NONE, Codec.INT8, Codec.INT4])
def test_int4_nvme_tier_round_trips_within_the_bound_from_every_tier_and_after_reopening(tmp_path, dram_codec):
    blocks, keys = kv_blocks(16), [key(i) for i in range(16)]
    with TieredKVStore(LAYOUT, tiers(dram_codec, Codec.INT4), eviction="lru", path=tmp_path) as store:
        store.put(keys, blocks)
        placed = where(store, keys)
        assert {"hbm", "dram", "nvme"} <= set(placed)
        for tier in ("hbm", "dram", "nvme"):
            index = [i for i, t in enumerate(placed) if t == tier]
            got = store.get([keys[i] for i in index])
            for i, block in zip(index, got):
                assert_within(Codec.INT4 if tier != "hbm" or dram_codec is not Codec.NONE else Codec.INT8, block, blocks[i])
        store.check_invariants()
    with TieredKVStore(LAYOUT, tiers(dram_codec, Codec.INT4), eviction="lru", path=tmp_path) as store:
        assert all(t is not None for t in where(store, keys))  # close() persisted every block to NVMe
        got = store.get(keys)
        for i in range(16):
            assert_within(Codec.INT4, got[i], blocks[i])


def test_blocks_moving_down_tiers_of_one_codec_are_quantised_once(tmp_path):
    """DRAM and NVMe both INT4: HBM -> DRAM encodes, DRAM -> NVMe moves the encoded bytes as
    they are, so every block on disk is exactly one encoding of what was put."""
    blocks, keys = kv_blocks(12), [key(i) for i in range(12)]
    with TieredKVStore(LAYOUT, tiers(Codec.INT4, Codec.INT4), eviction="lru", path=tmp_path) as store:
        store.put(keys, blocks)
        assert set(where(store, keys)) == {"hbm", "dram", "nvme"}
    impl = codec_for(Codec.INT4)
    with NVMeStore(tmp_path, LAYOUT, codec=Codec.INT4) as nvme:
        raw = [torch.empty(nvme.chunk_bytes, dtype=torch.uint8) for _ in keys]
        assert nvme.submit_get_encoded(keys, raw).result().all()
    for block, encoded in zip(blocks, raw):
        assert torch.equal(encoded, impl.to_bytes(impl.encode(block)))


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.FP8, Codec.INT4])
def test_blocks_moving_up_and_down_many_times_keep_their_error(tmp_path, codec):
    """A promoted block is dequantised in HBM and quantised again when it is demoted: INT8 and
    FP8 re-encode a decoded block to the same bytes, INT4 settles within a few round trips,
    so the error stays that of one round trip (INT4: within 5%; 1-2% seen on these small blocks)."""
    blocks, keys = kv_blocks(10), [key(i) for i in range(10)]
    with TieredKVStore(LAYOUT, tiers(codec, codec, nvme=16), eviction="lru", path=tmp_path) as store:
        store.put(keys, blocks)
        for _ in range(4):  # HBM holds 3: every get promotes, every promotion demotes another
            for i in range(10):
                store.get([keys[i]])
        got = store.get(keys)
        store.check_invariants()
    for i in range(10):
        single = rel_err(once(codec, blocks[i]), blocks[i])
        assert rel_err(got[i], blocks[i]) <= (1.05 if codec is Codec.INT4 else 1.0) * single + 1e-6
        assert_within(codec, got[i], blocks[i])


def test_a_store_reopened_with_another_codec_is_refused_naming_both(tmp_path):
    with TieredKVStore(LAYOUT, tiers(Codec.NONE, Codec.INT4), path=tmp_path) as store:
        store.put([key(0)], kv_blocks(1))
    for other in (Codec.NONE, Codec.INT8):
        with pytest.raises(UserError, match=f"codec 'int4', asked for codec '{other.value}'"):
            TieredKVStore(LAYOUT, tiers(Codec.NONE, other), path=tmp_path)
    with TieredKVStore(LAYOUT, tiers(Codec.NONE, Codec.INT4), path=tmp_path) as store:
        assert where(store, [key(0)]) == ["nvme"]  # the refusals changed nothing


def test_a_store_written_before_codecs_were_recorded_reads_as_codec_none(tmp_path):
    with NVMeStore(tmp_path, LAYOUT, 4) as store:
        store.put([key(1)], kv_blocks(1))
        store.flush()
    meta = tmp_path / "zarr.json"
    doc = json.loads(meta.read_text())
    del doc["attributes"]["tiercache"]["codec"]
    meta.write_text(json.dumps(doc))
    with NVMeStore(tmp_path, LAYOUT) as store:
        assert store.contains(key(1)) and store.codec is Codec.NONE
    with pytest.raises(UserError, match="codec 'none', asked for codec 'fp8'"):
        NVMeStore(tmp_path, LAYOUT, codec="fp8")


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_store_of_the_codecs_older_block_format_is_refused_and_left_intact(tmp_path, codec):
    """INT8 and INT4 blocks changed layout (format 2: refined outlier key channels); a store
    that records no format (format 1) is refused before anything is read, adopted or removed."""
    with NVMeStore(tmp_path, LAYOUT, 4, codec=codec) as store:
        store.put([key(1)], kv_blocks(1))
        store.flush()
    meta = tmp_path / "zarr.json"
    doc = json.loads(meta.read_text())
    assert doc["attributes"]["tiercache"]["codec_format"] == 2
    del doc["attributes"]["tiercache"]["codec_format"]
    meta.write_text(json.dumps(doc))
    files = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(UserError, match=f"{codec} blocks in format 1, this tiercache reads format 2"):
        NVMeStore(tmp_path, LAYOUT, codec=codec)
    assert sorted(p.name for p in tmp_path.rglob("*")) == files


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.FP8, Codec.INT4])
def test_quantised_chunks_are_zarr_readable_encoded_bytes(tmp_path, codec):
    blocks = kv_blocks(3)
    keys = [key(i) for i in range(3)]
    with NVMeStore(tmp_path, LAYOUT, 8, codec=codec) as store:
        store.put(keys, blocks)
        store.flush()
        slots = [store.slot_of(k) for k in keys]
        raw = [torch.empty(store.chunk_bytes, dtype=torch.uint8) for _ in keys]
        assert store.submit_get_encoded(keys, raw).result().all()
    array = zarr.open_array(os.fspath(tmp_path), mode="r")
    impl = codec_for(codec)
    assert array.shape == (8, codec.block_bytes(LAYOUT)) and array.dtype == np.uint8
    for slot, block, encoded in zip(slots, blocks, raw):
        assert np.array_equal(array[slot], impl.to_bytes(impl.encode(block)).numpy())
        assert np.array_equal(array[slot], encoded.numpy())


def test_encoded_puts_and_gets_are_checked(tmp_path):
    with NVMeStore(tmp_path, LAYOUT, 4, codec="int8") as store:
        with pytest.raises(UserError, match=f"{store.chunk_bytes} bytes"):
            store.submit_put_encoded([key(0)], [torch.empty(store.chunk_bytes - 1, dtype=torch.uint8)])
        with pytest.raises(UserError, match="list of 1"):
            store.submit_get_encoded([key(0)], torch.empty(1, store.chunk_bytes, dtype=torch.uint8))
        with pytest.raises(UserError, match="unknown codec"):
            NVMeStore(tmp_path / "other", LAYOUT, 4, codec="int3")


def test_capacity_follows_the_codecs_bytes_per_block():
    layout = KVLayout(layers=32, kv_heads=8, head_dim=128, dtype="float16", block_tokens=256)
    for codec in Codec:
        assert parse_capacity("64GiB", layout, codec=codec) == 64 * 2**30 // codec.block_bytes(layout)
    assert parse_capacity("64GiB", layout, codec=Codec.INT4) >= 3.5 * parse_capacity("64GiB", layout)
    pool = QuantizedPool(LAYOUT, 5, Codec.INT4)
    assert pool.encoded.shape == (5, Codec.INT4.block_bytes(LAYOUT)) and pool.encoded.dtype == torch.uint8
    with pytest.raises(UserError, match="cannot be read in place"):
        pool.tensor  # noqa: B018 (code that reads a plain pool's blocks in place must not read these)


def test_quantised_hbm_and_bad_codecs_are_refused(tmp_path):
    with pytest.raises(UserError, match="hbm tier stores blocks as given"):
        TieredKVStore(LAYOUT, [TierConfig("hbm", 2, codec=Codec.INT8)])
    with pytest.raises(UserError, match="unknown codec"):
        TierConfig("dram", 2, codec="int2")
    with pytest.raises(UserError, match="int8, fp8 or int4"):
        QuantizedPool(LAYOUT, 2, Codec.NONE)


# ----- crash safety holds for a quantised NVMe store too ----------------------------------

def crash_child() -> str:
    """The crash test's writer child (``test_nvme_crash.child_script``) on an INT4 store."""
    from test_nvme_crash import child_script

    return child_script("torch.randn((1, 2, 2, 2, 64, 64), generator=g).half()",
                        'KVLayout(layers=2, kv_heads=2, head_dim=64, dtype="float16", block_tokens=64)', ', codec="int4"')


def crash_block(i: int) -> torch.Tensor:
    return torch.randn((2, 2, 2, 64, 64), generator=torch.Generator().manual_seed(i)).half()


def test_a_killed_writer_of_an_int4_store_loses_nothing_confirmed_and_serves_nothing_torn(tmp_path):
    import random

    from test_nvme_crash import confirmed, run_and_kill

    path = str(tmp_path / "store")
    lines = run_and_kill(path, 0, True, random.Random(99), crash_child())
    present, deleted = confirmed(lines)
    with NVMeStore(path, LAYOUT, codec=Codec.INT4) as store:
        store.check_invariants()
        held = {int(k[1:]) for k, _ in store.items()}
        assert present <= held and not (held & deleted)
        out = torch.empty((1, *LAYOUT.block_shape), dtype=torch.float16)
        for i in sorted(held):
            assert store.get([b"k%d" % i], out)[0], f"block {i} indexed but unreadable"
            assert torch.equal(out[0], once(Codec.INT4, crash_block(i))), f"block {i} torn"
        assert store.stats["corrupt_reads"] == 0


def test_the_decode_loop_reads_an_int4_nvme_tier_and_refuses_a_quantised_dram_tier_clearly(tmp_path):
    from tiercache import TieredKVCache

    kv = lambda t: torch.randn(2, t, 64).half()  # noqa: E731
    prompt = list(range(1500))
    for dram, ok in (("none", True), ("int8", False)):
        tiers = [TierConfig("hbm", 8), TierConfig("dram", 8, codec=dram), TierConfig("nvme", 256, codec="int4")]
        with TieredKVCache(LAYOUT, tiers, path=tmp_path / dram) as cache:
            seq = cache.sequence(tokens=prompt)
            for layer in range(LAYOUT.layers):
                seq.append(layer, kv(len(prompt)), kv(len(prompt)))
            q = torch.randn(8, 1, 64).half()
            if ok:
                assert torch.isfinite(seq.attend(0, q)).all() and seq.reports[-1].from_nvme > 0
            else:  # the last layer appended has blocks in DRAM
                with pytest.raises(UserError, match="quantised"):
                    seq.attend(LAYOUT.layers - 1, q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quantised_tiers_under_a_gpu_hbm_tier_encode_and_decode_on_the_gpu(tmp_path):
    blocks, keys = kv_blocks(16), [key(i) for i in range(16)]
    with TieredKVStore(LAYOUT, tiers(Codec.INT8, Codec.INT4), path=tmp_path, device="cuda") as store:
        store.put(keys, blocks.cuda())
        assert {"hbm", "dram", "nvme"} <= set(where(store, keys))
        got = store.get(keys).cpu()
        for i in range(16):
            assert_within(Codec.INT4, got[i], blocks[i])
