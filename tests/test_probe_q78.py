"""Probe Q78 (19,152 compiled-vs-Python replays, plain-Python models and libCacheSim all
agreed): ``--layout`` values a ``KVLayout`` refuses were named as ``KVLayout.layers`` and so
on, not as the option the user gave (README: one line naming the option)."""

from __future__ import annotations

import pytest

from tiercache.cli import main


@pytest.mark.parametrize("layout, named", [("layers=0,kv_heads=8,head_dim=128", "--layout: layers: must be a positive"),
                                           ("layers=2,kv_heads=8,head_dim=128,heads=0", "--layout: heads: must be"),
                                           ("layers=2,kv_heads=8,head_dim=128,dtype=int7", "--layout: dtype: unknown dtype")])
def test_a_layout_value_the_layout_refuses_is_named_as_the_option(tmp_path, capsys, layout, named):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [1]}\n')
    assert main(["replay", str(trace), "--capacity", "4", "--layout", layout, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert named in err and "KVLayout" not in err and err.count("\n") == 1


@pytest.mark.parametrize("heads", [4, 12])
def test_query_heads_that_are_no_multiple_of_the_kv_heads_are_refused(tmp_path, capsys, heads):
    """Probe Q80-7: fewer query heads than KV heads, or a count they do not divide, fed the
    attention FLOPs of a model that cannot exist."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [1]}\n')
    layout = f"layers=2,kv_heads=8,head_dim=128,heads={heads}"
    assert main(["replay", str(trace), "--capacity", "4", "--layout", layout, "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"tiercache replay: error: --layout: heads: query heads must be a multiple of "
                                       f"kv_heads, got heads={heads} with kv_heads=8\n")
