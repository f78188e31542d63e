"""Probe q46 of the benchmark scripts: a bad --device or an odd head dimension ends
bench_hf_cache.py in one line before any model is built."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="bench_hf_cache.py needs the hf extra (pip install -e '.[hf]')")

from test_bench_honesty import _script  # noqa: E402


@pytest.mark.parametrize("extra, says", [
    (["--device", "foo"], "--device: TieredKVStore: device 'foo' is not a device"),
    (["--device", "meta"], "--device:"),
    (["--hidden", "24", "--heads", "8"], "--hidden / --heads must be even"),
])
def test_bad_model_options_end_in_one_line(extra, says, capsys):
    bench = _script("bench_hf_cache")
    with pytest.raises(SystemExit) as done:
        bench.parse_args(extra)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
