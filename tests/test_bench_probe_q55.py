"""Probe Q55: options of the bench scripts checked before any work.

``bench_quant --logit-std nan`` printed NaN errors and wrote bare NaN into its JSON (exit 0);
``-1`` and ``0`` were taken (the table said "std -1.0"; 0 made attention uniform, measuring
something else). ``bench_memory --full-max -7`` was taken silently.
"""

from __future__ import annotations

import pytest

from test_script_bench_honesty import _script


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "x"])
def test_bench_quant_refuses_a_logit_std_that_is_not_a_finite_positive_number(value, capsys):
    with pytest.raises(SystemExit) as stopped:
        _script("bench_quant").main(["--logit-std", value, "--no-disk"])
    assert stopped.value.code == 2
    assert f"--logit-std: expected a finite number > 0, got {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1e39", "1e-46"])
def test_bench_quant_refuses_a_logit_std_float32_cannot_hold(value, capsys):
    """Review R32: 1e39 wrote NaN errors into the JSON; 1e-46 made every query logit 0."""
    with pytest.raises(SystemExit) as stopped:
        _script("bench_quant").main(["--logit-std", value, "--no-disk"])
    assert stopped.value.code == 2
    assert "--logit-std: expected a number from 0.001 to 1000" in capsys.readouterr().err


def test_bench_memory_refuses_a_negative_full_max(capsys):
    with pytest.raises(SystemExit) as stopped:
        _script("bench_memory").main(["--full-max", "-7"])
    assert stopped.value.code == 2
    assert "--full-max: expected a positive integer, got -7" in capsys.readouterr().err
