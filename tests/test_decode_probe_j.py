"""Probe J (decode loop): a refused ``TieredKVCache`` leaves nothing open; outputs are bit
for bit the same whatever the tiers and the prefetch policy; a numpy or 0-d tensor integer
is a layer; ``scripts/long_context.py`` reports per-step bytes over every layer, the tokens
it built and the budget it used."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tiercache import AttentionMode, TieredKVCache
from tiercache.config import KVLayout, TierConfig
from tiercache.errors import UserError
from tiercache.live.chunks import split_kv

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="float16", block_tokens=4)


def _tiers(hbm: int, dram: int, nvme: int = 256) -> list[TierConfig]:
    tiers = [TierConfig("hbm", hbm), TierConfig("dram", dram)]
    return tiers + [TierConfig("nvme", nvme)] if nvme else tiers


def _cache(path: Path, hbm: int = 3, dram: int = 5, nvme: int = 256, **options) -> TieredKVCache:
    return TieredKVCache(LAYOUT, _tiers(hbm, dram, nvme), path=path if nvme else None, device="cpu", **options)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----- a refused constructor closes what it opened ------------------------------------------


def test_a_refused_speculate_leaves_the_store_path_free(tmp_path):
    with pytest.raises(UserError, match="speculate"):
        _cache(tmp_path / "store", speculate=5)
    with _cache(tmp_path / "store") as cache:  # the same path, in the same process
        assert cache.sequence().length() == 0


def test_an_unwritable_record_path_is_named_and_leaves_the_store_path_free(tmp_path):
    record = tmp_path / "missing" / "steps.jsonl"
    with pytest.raises(UserError, match=r"record=.*missing/steps\.jsonl.*cannot be written"):
        _cache(tmp_path / "store", record=record)
    with _cache(tmp_path / "store") as cache:
        assert cache.sequence().length() == 0


# ----- the same inputs give the same bits, wherever the blocks lie --------------------------


def _decode(cache: TieredKVCache, seed: int = 0, steps: int = 3) -> list[torch.Tensor]:
    """Exact and sparse outputs of a fixed two-layer decode (80 prompt tokens, ``steps`` steps)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).half()

    seq = cache.sequence()
    for layer in range(2):
        seq.append(layer, randn(2, 80, 16), randn(2, 80, 16))
    outs = []
    for _ in range(steps):
        for layer in range(2):
            seq.append(layer, randn(2, 1, 16), randn(2, 1, 16))
            q = randn(8, 1, 16)
            outs.append(seq.attend(layer, q))
            outs.append(seq.attend(layer, q, AttentionMode.SPARSE, budget=0.3))
    return outs


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[int]:
    """Indices of the outputs whose bits differ."""
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if not torch.equal(x, y)]


def test_outputs_are_bit_identical_across_prefetch_policies(tmp_path):
    runs = {}
    for prefetch in ("none", "layer_ahead", "topk_speculative"):
        with _cache(tmp_path / prefetch, hbm=4, dram=8, prefetch=prefetch, window_blocks=4) as cache:
            runs[prefetch] = _decode(cache)
    assert _same_bits(runs["none"], runs["layer_ahead"]) == []
    assert _same_bits(runs["none"], runs["topk_speculative"]) == []


def test_outputs_are_bit_identical_whatever_the_tiers(tmp_path):
    with _cache(tmp_path / "memory", hbm=256, dram=4, nvme=0, window_blocks=4) as cache:
        in_hbm = _decode(cache)
    for write_through in (False, True):
        with _cache(tmp_path / f"spread-{write_through}", hbm=2, dram=3, window_blocks=4,
                    write_through=write_through) as cache:
            assert _same_bits(in_hbm, _decode(cache)) == []


def test_a_chunk_spanning_tiers_is_read_in_block_order(tmp_path):
    """``raw`` (what the benchmarks time) and ``finish`` (what attention computes on) give a
    chunk's blocks in block order, its blocks being on NVMe, in DRAM and in HBM."""
    k, v = torch.randn(2, 40, 16).half(), torch.randn(2, 40, 16).half()
    with _cache(tmp_path / "store", hbm=3, dram=3, window_blocks=4, prefetch="none") as cache:
        seq = cache.sequence()
        seq.append(0, k, v)
        source = seq.stream_source(0)
        assert any(len(chunk.pieces) > 1 for chunk in source.chunks)  # the test needs a mixed chunk
        assert sorted({piece.tier for chunk in source.chunks for piece in chunk.pieces}) == [0, 1, 2]
        raw_k, finished_k, finished_v = [], [], []
        for index in range(source.n_chunks):
            raw_k.append(split_kv(source.raw(source.start(index, 0)))[0])
            chunk_k, chunk_v = source.finish(source.start(index, 0))
            finished_k.append(chunk_k.clone())
            finished_v.append(chunk_v.clone())
    assert torch.equal(torch.cat(raw_k, 1), k.float())
    assert torch.equal(torch.cat(finished_k, 1), k.float()) and torch.equal(torch.cat(finished_v, 1), v.float())


# ----- a layer is any integer, never a bool --------------------------------------------------


def test_a_numpy_or_0d_tensor_integer_is_a_layer_and_is_recorded_as_an_int(tmp_path):
    record = tmp_path / "steps.jsonl"
    with _cache(tmp_path / "store", record=record) as cache:
        seq = cache.sequence()
        k, v = torch.randn(2, 9, 16).half(), torch.randn(2, 9, 16).half()
        seq.append(np.int64(0), k, v)
        seq.append(torch.tensor(1), k, v)
        q = torch.randn(4, 1, 16).half()
        assert torch.equal(seq.attend(np.int32(1), q), seq.attend(1, q))
        assert seq.length(np.uint8(0)) == seq.blocks(np.int16(0)) * 4 + 1 == 9
    layers = [json.loads(line).get("layer") for line in record.read_text().splitlines()[1:]]
    assert 1 in layers and all(type(layer) is int for layer in layers if layer is not None)


@pytest.mark.parametrize("layer", [True, np.bool_(False), torch.tensor(True), torch.tensor([0]), 0.0, np.int64(2), -1])
def test_a_bool_a_float_or_an_out_of_range_layer_is_refused(tmp_path, layer):
    with _cache(tmp_path / "store", nvme=0) as cache:
        seq = cache.sequence()
        seq.append(0, torch.randn(2, 5, 16).half(), torch.randn(2, 5, 16).half())
        with pytest.raises(UserError, match=r"Sequence.attend: layer must be an integer in \[0, 2\)"):
            seq.attend(layer, torch.randn(4, 1, 16).half())


# ----- long_context.py: every figure in the unit its label says -------------------------------

_LONG = ["--tokens", "1000", "--block-tokens", "64", "--layers", "2", "--kv-heads", "1", "--head-dim", "16", "--q-heads", "2",
         "--hbm", "2", "--dram", "2", "--steps", "2", "--exact-steps", "2", "--reference-steps", "1", "--needles", "2",
         "--window-blocks", "4", "--depth", "2", "--budget", "3", "--timing-repeats", "1", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def long_context_run(tmp_path_factory):
    lc = _script("long_context")
    figures = lc.run(lc.parse_args(_LONG + ["--path", str(tmp_path_factory.mktemp("long"))]))
    return lc, figures


def test_long_context_bytes_per_step_are_every_layers_reads(long_context_run):
    _, figures = long_context_run
    layers, block_bytes = figures["layout"]["layers"], figures["layout"]["block_bytes"]
    exact = figures["bytes_read_per_step"]["exact"]
    # an exact step reads every full block of every layer (the 15 prompt blocks: decode stays in the tail)
    assert exact["hbm"] + exact["dram"] + exact["nvme"] == 15 * layers * block_bytes
    sparse = figures["bytes_read_per_step"]["sparse"]
    assert sparse["hbm"] + sparse["dram"] + sparse["nvme"] == 3 * layers * block_bytes  # --budget 3, both layers


def test_long_context_reports_the_tokens_built_and_the_budget_used(long_context_run, capsys):
    lc, figures = long_context_run
    assert figures["tokens"] == 960 and figures["tokens_requested"] == 1000 and figures["blocks_per_layer"] == 15
    assert figures["budget"] == 3 and isinstance(figures["budget"], int)
    assert figures["sparse_blocks_selected"] == 3
    lc.print_table(figures)
    assert "960 (--tokens 1,000 rounded down to whole blocks of 64)" in capsys.readouterr().out


@pytest.mark.parametrize("budget", ["2.9", "0", "-1", "nan", "inf"])
def test_long_context_refuses_a_budget_it_cannot_use_as_given(budget, capsys):
    lc = _script("long_context")
    with pytest.raises(SystemExit):
        lc.parse_args(["--budget", budget])
    assert "--budget: a share of the blocks in (0, 1] or a whole number of blocks above 1" in capsys.readouterr().err
