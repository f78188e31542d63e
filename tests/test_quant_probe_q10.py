"""Probe q10 on the quantised tiers and codecs (``/tmp/q10/FINDINGS.md``, items 1-5).

1. A block a quantised tier cannot encode (inf, NaN, values too large for its fp16 scales),
   adopted from a plain NVMe store reopened under a hierarchy with a quantised tier, used to
   stay in HBM for good (every demotion into the quantised tier failed and was retried) and,
   once such blocks filled HBM, every ``put`` was refused. Now the demotion drops it as lost
   (counted, key forgotten), as an unreadable chunk is, and the ``put`` goes through.
2. INT4's 7-bit scales cannot keep every value within half a step: a group's extreme values
   may be clipped by more (up to ``INT4_MAX_CLIP_STEPS``); the bound is now documented, and
   checked on adversarial groups like the probe's.
3. INT4 decoded values of ~1e-30 in its refined key channels as -2^-28; now 0, as elsewhere.
4. A prime block_tokens or head_dim above 64 gives codec groups of one value, and an INT4 or
   INT8 tier larger than plain: refused at construction and by ``tiercache replay``; the
   bytes a hop charges follow the tier's codec, not a size comparison.
5. bf16 INT4 blocks with outlier key channels may change one ``k_fine`` nibble at the first
   re-encode (the decoded values stay equal; the bytes are stable from then on): documented.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tiercache import TieredKVStore  # noqa: E402
from tiercache.cli import main  # noqa: E402
from tiercache.config import Codec, KVLayout, TierConfig, parse_tiers  # noqa: E402
from tiercache.core.plans import TransferPlan  # noqa: E402
from tiercache.data.codecs import codec_for  # noqa: E402
from tiercache.data.handlers import CopyContext  # noqa: E402
from tiercache.data.nvme import NVMeStore  # noqa: E402
from tiercache.data.pools import BlockPool  # noqa: E402
from tiercache.data.quantized import PoolToQuantized, QuantizedPool, QuantizedToQuantized, StoreToQuantized  # noqa: E402
from tiercache.errors import ConfigError  # noqa: E402
from tiercache.sizes import hop_block_bytes, move_hops  # noqa: E402

from store_helpers import key  # noqa: E402

SMALL = KVLayout(layers=1, kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)

# ----------------------------------------------------------------------------- item 1


def _with_bad(layout: KVLayout, bad: float, n: int, bad_rows: tuple[int, ...]) -> torch.Tensor:
    """``n`` random blocks of ``layout``; blocks ``bad_rows`` hold one value ``bad``."""
    gen = torch.Generator().manual_seed(3)
    blocks = torch.randn((n, *layout.block_shape), generator=gen).to(getattr(torch, layout.dtype))
    for row in bad_rows:
        blocks[row, 0, 1, 0, 3, 7] = bad
    return blocks


@pytest.mark.parametrize("dtype, bad, codec", [("float16", float("nan"), "int8"), ("bfloat16", 2e6, "int4"),
                                               ("float32", float("inf"), "fp8")])
def test_unencodable_blocks_adopted_from_a_plain_store_fall_back_to_nvme_not_stuck_in_hbm(tmp_path, dtype, bad, codec):
    """Pushed out of HBM into a quantised DRAM tier that cannot encode them, the blocks read up
    from the plain NVMe store go back onto their retained NVMe copies (probe q30 finding 1:
    they were dropped as lost, and their durable copies with them); the put goes ahead."""
    layout = KVLayout(layers=1, kv_heads=2, head_dim=64, dtype=dtype, block_tokens=16)
    old, old_keys = _with_bad(layout, bad, 4, (1, 2)), [key(i) for i in range(4)]
    with TieredKVStore(layout, [TierConfig("hbm", 2), TierConfig("nvme", 64)], path=tmp_path) as store:
        assert store.put(old_keys, old) == 4  # a plain hierarchy stores any values (documented)
    tiers = [TierConfig("hbm", 2), TierConfig("dram", 4, codec=codec), TierConfig("nvme", 64)]
    with TieredKVStore(layout, tiers, path=tmp_path) as store:
        store.get([old_keys[1]])
        store.get([old_keys[2]])  # both bad blocks now fill HBM
        assert store.lookup(old_keys[1:3])[1] == ["hbm", "hbm"]
        new, new_keys = _with_bad(layout, 0.0, 3, ()), [key(100 + i) for i in range(3)]
        assert store.put(new_keys, new) == 3  # was 0, and 0 again on every retry
        store.check_invariants()
        hbm = store.stats()["tiers"][0]
        assert (hbm["lost"], hbm["refused"]) == (0, 0)
        assert store.lookup(old_keys)[1][1:3] == ["nvme", "nvme"]  # not stuck in HBM, not lost
        for row, kept in zip((1, 2), old_keys[1:3]):  # the stored bytes, bit for bit (NaN too)
            assert torch.equal(store.get([kept]).view(torch.uint8), old[row : row + 1].view(torch.uint8))
        assert torch.equal(store.get([old_keys[0]]), old[:1])  # plain NVMe: exact
        got = store.get(new_keys)
        assert torch.isfinite(got).all() and got.shape == new.shape
        store.check_invariants()


def _context(keys: list[bytes]) -> CopyContext:
    return CopyContext(lambda block_id: keys[block_id], None, None, None, lambda: None)


def test_an_unencodable_block_read_from_a_plain_store_into_a_quantised_tier_is_lost(tmp_path):
    blocks, keys = _with_bad(SMALL, float("nan"), 2, (0,)), [key(0), key(1)]
    store = NVMeStore(tmp_path, SMALL, 8)
    try:
        store.put(keys, blocks)
        pool = QuantizedPool(SMALL, 2, Codec.INT4)
        plan = TransferPlan(7, (0, 1), 0, np.arange(2), 1, np.arange(2))
        job = StoreToQuantized().start(plan, store, pool, _context(keys))
        result = job.finish(job.future.result())
    finally:
        store.close()
    assert not result.ok and result.lost == (0,)
    assert "int4" in result.error and "NaN" in result.error


def test_a_demotion_that_cannot_encode_a_block_reports_it_lost():
    blocks = _with_bad(SMALL, float("nan"), 3, (1,))
    src, dst = BlockPool(SMALL, 3), QuantizedPool(SMALL, 3, Codec.INT8)
    src.write(np.arange(3), blocks)
    plan = TransferPlan(4, (10, 11, 12), 0, np.arange(3), 1, np.arange(3))
    result = PoolToQuantized().start(plan, src, dst, _context([])).result
    assert not result.ok and result.lost == (11,)
    assert "int8" in result.error and "1 block" in result.error


def test_a_block_another_codec_cannot_re_encode_is_lost_on_its_way_between_quantised_tiers():
    """An FP8 block of bf16 values beyond INT4's fp16 scales (FP8 takes any finite value)."""
    layout = KVLayout(layers=1, kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
    src, dst = QuantizedPool(layout, 2, Codec.FP8), QuantizedPool(layout, 2, Codec.INT4)
    src.write(np.arange(2), _with_bad(layout, 2e6, 2, (0,)))
    plan = TransferPlan(5, (20, 21), 0, np.arange(2), 1, np.arange(2))
    result = QuantizedToQuantized().start(plan, src, dst, _context([])).result
    assert not result.ok and result.lost == (20,) and "int4" in result.error


# ----------------------------------------------------------------------------- item 2


def _v_groups(lows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One block whose V rows (groups of 64 along head_dim) are the probe's adversarial
    groups: min ``lows[t]``, max 1, the rest spread between; K all zero."""
    tokens = lows.numel()
    x = torch.zeros(1, 2, 1, tokens, 64, dtype=torch.float64)
    between = torch.linspace(0, 1, 62, dtype=torch.float64)
    x[0, 1, 0] = torch.cat([lows[:, None], torch.ones(tokens, 1, dtype=torch.float64),
                            lows[:, None] + (1 - lows[:, None]) * between], dim=1)
    return x.to(dtype)


@pytest.mark.parametrize("dtype, path", [(torch.float32, "reference"), (torch.float16, "compiled"),
                                         (torch.bfloat16, "compiled")])
def test_int4_values_stay_within_the_documented_clip_bound_on_adversarial_groups(dtype, path):
    from tiercache.data.codec_base import INT4_MAX_CLIP_STEPS

    c = codec_for("int4")
    lows = -torch.linspace(0.0, 1.0, 4096, dtype=torch.float64)
    x = _v_groups(lows, dtype)
    encode, decode = (c.encode, c.decode) if path == "compiled" else (c.encode_reference, c.decode_reference)
    q = encode(x)
    got = decode(q, torch.empty_like(x)).double()[0, 1, 0]
    v = x.double()[0, 1, 0]
    scale, zero = q.scales[2].double()[0, 0, :, 0], q.scales[3].double()[0, 0, :, 0]  # [tokens, 1]
    steps = (got - v).abs() / scale
    # The decoded value is rounded to the block's dtype: up to half its spacing more.
    rounding = (got.abs() * torch.finfo(dtype).eps / 2) / scale
    unclamped = v / scale + zero
    inside = (unclamped >= -0.5) & (unclamped <= 15.5)
    assert bool((steps[inside] <= 0.5 + rounding[inside] + 1e-9).all())
    assert float((steps - rounding).max()) <= INT4_MAX_CLIP_STEPS
    assert float((steps - rounding).max()) > 0.6  # the exception is real: more than half a step
    # The probe's group: min -0.1099, max 1 -> scale 0.0732, zero 2; 1 decodes to 0.952.
    probe = _v_groups(torch.tensor([-0.10990642756223679], dtype=torch.float64), torch.float32)
    q = c.encode_reference(probe)
    top = c.decode_reference(q, torch.empty_like(probe))[0, 1, 0, 0, 1]
    assert float(q.scales[2].flatten()[0]) == 0.0732421875 and int(q.scales[3].flatten()[0]) == 2
    assert abs(float(top) - 1.0) / 0.0732421875 == pytest.approx(0.6533, abs=1e-4)


def test_int4_scale_docstring_states_the_bound_it_keeps():
    from tiercache.data.codec_base import INT4_MAX_CLIP_STEPS, int4_scale

    assert "no value clipped by more than half a step" not in int4_scale.__doc__
    assert "INT4_MAX_CLIP_STEPS" in int4_scale.__doc__ and 0.5 < INT4_MAX_CLIP_STEPS < 1


# ----------------------------------------------------------------------------- item 3


@pytest.mark.parametrize("dtype, path", [(torch.float32, "reference"), (torch.bfloat16, "compiled"),
                                         (torch.bfloat16, "reference")])
def test_int4_decodes_values_far_below_its_scale_floor_as_zero(dtype, path):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 2, 2, 16, 64, dtype=torch.float64, generator=gen) * 1e-30).to(dtype)
    c = codec_for("int4")
    encode, decode = (c.encode, c.decode) if path == "compiled" else (c.encode_reference, c.decode_reference)
    out = decode(encode(x), torch.empty_like(x))
    assert int((out != 0).sum()) == 0, sorted(set(out[out != 0].tolist()))


def test_int4_tiny_groups_still_encode_the_same_bytes_by_both_paths():
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(1, 2, 2, 16, 64, dtype=torch.float64, generator=gen) * 1e-30).to(torch.bfloat16)
    x[0, 0, 0, :, 5] *= 1e22  # one key channel of ordinary magnitude beside the tiny ones
    c = codec_for("int4")
    fast, ref = c.encode(x), c.encode_reference(x)
    assert all(torch.equal(a, b) for a, b in zip(fast.tensors, ref.tensors))


# ----------------------------------------------------------------------------- item 4


@pytest.mark.parametrize("tokens, dim, codec", [(67, 128, "int4"), (256, 127, "int4"), (256, 127, "int8"),
                                                (16, 97, "int8")])
def test_a_quantised_tier_larger_than_plain_is_refused_at_construction(tmp_path, tokens, dim, codec):
    layout = KVLayout(layers=1, kv_heads=2, head_dim=dim, dtype="float16", block_tokens=tokens)
    encoded = Codec(codec).block_bytes(layout)
    assert encoded >= layout.block_bytes
    with pytest.raises(ConfigError) as err:
        TieredKVStore(layout, [TierConfig("hbm", 1), TierConfig("dram", 8, codec=codec)])
    message = str(err.value)
    for named in ("tier dram", f"codec {codec}", f"block_tokens={tokens}", f"head_dim={dim}", f"{encoded:,}",
                  f"{layout.block_bytes:,}", "groups of one value"):
        assert named in message, (named, message)


def test_fp8_of_a_prime_block_size_is_smaller_than_plain_and_accepted():
    layout = KVLayout(layers=1, kv_heads=2, head_dim=128, dtype="float16", block_tokens=67)
    with TieredKVStore(layout, [TierConfig("hbm", 1), TierConfig("dram", 8, codec="fp8")]) as store:
        assert store.tier_block_bytes[1] < layout.block_bytes


def test_replay_tier_parsing_refuses_a_quantised_tier_larger_than_plain(tmp_path, capsys):
    layout = KVLayout(layers=1, kv_heads=2, head_dim=128, dtype="float16", block_tokens=67)
    with pytest.raises(ConfigError, match=r"--tiers dram: codec int4 .*block_tokens=67"):
        parse_tiers("hbm=1,dram=8:int4", layout)
    assert parse_tiers("hbm=1,dram=8:fp8", layout)[1].codec is Codec.FP8
    trace = tmp_path / "steps.jsonl"
    trace.write_text('{"block_tokens": 67}\n{"step": 0, "layer": 0, "read": [], "write": [0]}\n'
                     '{"step": 1, "layer": 0, "read": [0], "write": []}\n')
    code = main(["replay", str(trace), "--tiers", "hbm=1,dram=8:int4", "--layout", "layers=1,kv_heads=2,head_dim=128"])
    err = capsys.readouterr().err
    assert code == 2 and "codec int4" in err and "block_tokens=67" in err and "Traceback" not in err


def test_a_hop_into_a_quantised_tier_charges_its_codecs_bytes_whatever_their_size():
    plain, encoded = 68_608, 69_696  # the probe's INT4 block of 67 tokens, larger than plain
    assert hop_block_bytes("hbm", plain, "dram", encoded, dst_quantised=True) == encoded
    assert hop_block_bytes("dram", encoded, "hbm", plain, dst_quantised=False) == encoded
    assert hop_block_bytes("hbm", plain, "dram", plain, dst_quantised=False) == plain
    assert move_hops("hbm", plain, "dram", encoded, dst_quantised=True) == (("hbm->dram", encoded),)


# ----------------------------------------------------------------------------- item 5


def test_bf16_int4_reencode_keeps_values_and_settles_after_one_fine_nibble():
    """The probe's blocks: the first re-encode may change a ``k_fine`` nibble where bf16 rounds
    two fine steps to one value (README); the values never change, the bytes settle."""
    c = codec_for("int4")
    changed = 0
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn((3, 2, 3, 48, 80), generator=gen, dtype=torch.float64)
        x[..., 0, :, :, 3] *= 50
        x[..., 0, :, 5, :] *= 20
        x[..., 1, :, 7, 9] = 300
        x = x.to(torch.bfloat16)
        q1 = c.encode(x)
        y1 = c.decode(q1, torch.empty_like(x))
        q2 = c.encode(y1)
        y2 = c.decode(q2, torch.empty_like(x))
        q3 = c.encode(y2)
        names = [p.name for p in c.parts(q1.shape, q1.dtype)]
        differ = {n for n, a, b in zip(names, q1.tensors, q2.tensors) if not torch.equal(a, b)}
        assert differ <= {"k_fine"}
        changed += bool(differ)
        assert torch.equal(y1, y2)
        assert all(torch.equal(a, b) for a, b in zip(q2.tensors, q3.tensors))
    assert changed  # seed 0 is the probe's: one nibble moves
