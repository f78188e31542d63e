"""The comparison with transformers' quantised KV caches (issue 10 item 4): it runs where
transformers is installed and says why not otherwise; it never fails the benchmark."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")

from tiercache.bench import hf_quant  # noqa: E402

from test_codecs import synthetic_block  # noqa: E402


def test_comparison_runs_or_says_why_not():
    block = synthetic_block(2, 4, 128, 64)
    result = hf_quant.compare(block[:, 0], block[:, 1])
    assert set(result) == {"note", "layers"}
    if importlib.util.find_spec("transformers") is None:
        assert result["layers"] == [] and "not installed" in result["note"]
        return
    from transformers import cache_utils

    if not hasattr(cache_utils, "Fp8QuantizedLayer"):
        assert result["layers"] or result["note"]
    else:  # needs no backend (probe Q57: a comparison that ran nothing passed)
        assert "Fp8QuantizedLayer" in [entry["name"] for entry in result["layers"]], result["note"]
    for entry in result["layers"]:
        assert entry["k_hat"].shape == block[:, 0].shape and 0 <= entry["k_rel_err"] < 1 and 0 <= entry["v_rel_err"] < 1
        if entry["name"] == "Fp8QuantizedLayer":  # e4m3, one scale per tensor: the same relative rounding as ours
            assert 0.01 < entry["v_rel_err"] < 0.05
