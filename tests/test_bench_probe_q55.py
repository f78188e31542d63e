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


def _stopwatch_of(durations: list[float]):
    """A stopwatch whose successive regions (two reads each) last ``durations`` in turn."""
    def stopwatch(device):
        reads = iter(range(10**6))

        def now() -> float:
            region, end = divmod(next(reads), 2)
            return sum(durations[:region]) + end * durations[region]
        return now
    return stopwatch


def test_step_timings_ratios_are_medians_of_each_repeats_own_ratio(tmp_path, monkeypatch):
    """Probe Q55 minor: the overlap efficiency was max(median io, median compute) / median
    pipelined, pairing sides from different repeats; each repeat's sides are timed side by
    side, so the figure is the median of the repeats' own ratios (1/3, 2, 1.5 here: 1.5, where
    the ratio of medians gave 1.0)."""
    from tiercache.bench import decode as bdecode
    from test_script_bench_honesty import _small_sequence

    repeats = [(1.0, 0.1, 3.0), (2.0, 0.4, 1.0), (3.0, 0.2, 2.0)]  # io, compute, pipelined
    monkeypatch.setattr(bdecode, "_stopwatch", _stopwatch_of([d for repeat in repeats for d in repeat]))
    cache, seq, kv = _small_sequence(tmp_path)
    with cache:
        q, _ = kv.query(0, 4)
        timing = bdecode.step_timings(seq, 0, q, repeats=3)
    assert timing["overlap_efficiency"] == pytest.approx(1.5)
    assert timing["io_compute_ratio"] == pytest.approx(10.0)  # 10, 5 and 15
    assert (timing["io_only_seconds"], timing["pipelined_seconds"]) == pytest.approx((2.0, 2.0))


def test_bench_quant_checks_what_its_raw_disk_reads_read(tmp_path, monkeypatch):
    """Probe Q55 minor: the raw disk baseline's reads were never compared with what was
    written, so a read that delivered other bytes (a wrong offset, a short slot) would have
    been timed as the disk's rate. A run checks every read block; a corrupted one stops it."""
    import torch

    from tiercache.bench.rawio import RawBlockFiles
    from tiercache.config import Codec

    quant = _script("bench_quant")
    block = torch.randn(1, 2, 8, quant.TOKENS, quant.DIM, generator=torch.Generator().manual_seed(3)).half()
    checked = []
    real_check = quant.check_raw_reads

    def spy(files, slots, dests, sources, what):
        real_check(files, slots, dests, sources, what)
        checked.append(len(slots))

    monkeypatch.setattr(quant, "check_raw_reads", spy)
    (tmp_path / "ok").mkdir(), (tmp_path / "off").mkdir()
    quant.disk_rounds(Codec.INT8, block, str(tmp_path / "ok"), rounds=2, blocks=6)
    assert checked == [6, 6, 6]  # the warm-up read run and both rounds, every block
    real_read = RawBlockFiles.read

    def misplaced(self, slots, dests, threads):  # every read one slot off
        return real_read(self, (slots + 1) % self.capacity, dests, threads)

    monkeypatch.setattr(RawBlockFiles, "read", misplaced)
    with pytest.raises(quant.OutputMismatch, match="read back other bytes than were written there"):
        quant.disk_rounds(Codec.INT8, block, str(tmp_path / "off"), rounds=1, blocks=6)
