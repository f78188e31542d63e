"""Probe q43 of ``scripts/long_context.py``: the synthetic KV is the same whatever the
chunking (the float64 check regenerates it in other chunks than the build), and runs that
cannot work are refused before any work, naming the option."""

from __future__ import annotations

import random
from collections import namedtuple

import pytest
import torch

from test_bench_honesty import _TINY, _script
from tiercache.bench.decode import NeedleKV


def test_any_chunking_of_the_synthetic_kv_gives_the_same_tokens():
    kv = NeedleKV(16 * 600 + 16 * 3, 2, 8, 16, 3, seed=5)  # units of 16 * 256 tokens, the last one cut short
    prompt = kv.n_blocks * kv.block_tokens
    whole_k, whole_v = kv.chunk(0, prompt)
    rng = random.Random(7)
    for _ in range(40):
        start = rng.randrange(kv.n_blocks) * 16
        end = rng.randrange(start // 16, kv.n_blocks + 1) * 16
        k, v = kv.chunk(start, end - start)
        assert torch.equal(k, whole_k[:, start:end]) and torch.equal(v, whole_v[:, start:end]), (start, end)
    with pytest.raises(ValueError):
        kv.chunk(prompt - 16, 32)  # past the prompt


def test_a_run_with_non_default_chunks_checks_the_kv_it_stored(tmp_path):
    lc = _script("long_context")
    args = lc.parse_args(_TINY + ["--path", str(tmp_path), "--timing-repeats", "1", "--chunk-tokens", "512"])
    assert lc.run(args)["exact_max_rel_err"] < 1e-2  # 1.5 before: the check regenerated other KV


@pytest.mark.parametrize("extra, says", [
    (["--tokens", "32"], "--tokens: at least three blocks"),
    (["--reference-steps", "5", "--exact-steps", "2"], "--reference-steps 5: at most --exact-steps (2)"),
])
def test_impossible_runs_are_refused_naming_the_option(extra, says, capsys):
    lc = _script("long_context")
    with pytest.raises(SystemExit):
        lc.parse_args(_TINY + extra)
    assert says in capsys.readouterr().err


def test_a_run_larger_than_the_disk_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    lc = _script("long_context")
    monkeypatch.setattr(lc.shutil, "disk_usage", lambda path: namedtuple("usage", "total used free")(1 << 20, 0, 1 << 20))
    with pytest.raises(SystemExit):
        lc.parse_args(_TINY + ["--path", str(tmp_path), "--tokens", "100000"])
    assert "GiB free; lower --tokens" in capsys.readouterr().err


def test_chunks_smaller_than_a_unit_draw_each_unit_once(monkeypatch):
    kv = NeedleKV(16 * 256 * 2, 2, 8, 16, 3, seed=5)  # two units of 4,096 tokens
    drawn = []
    real = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: (drawn.append(a), real(*a, **k))[1])
    for start in range(0, kv.n_blocks * 16, 512):
        kv.chunk(start, 512)
    assert len([a for a in drawn if a[:3] == (2, 4096, 8)]) == 2 * 2  # K and V of each unit, once
