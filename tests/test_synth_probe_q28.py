"""Probe q28, finding 5: ``trace synth sparse`` with ``--k 0 --sink 0 --window 0`` (a step
that reads nothing) is refused before anything is written, as ``--blocks 0`` is; so is a
``SparseSpec`` of that kind."""

from __future__ import annotations

import pytest

from tiercache.cli import main
from tiercache.errors import UserError
from tiercache.sim.synth import SparseSpec


def test_a_sparse_trace_whose_steps_read_nothing_is_refused_before_it_is_written(tmp_path, capsys):
    out = tmp_path / "noreads.jsonl"
    code = main(["trace", "synth", "sparse", "-o", str(out), "--k", "0", "--sink", "0", "--window", "0", "--steps", "5"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not out.exists()
    assert len(err.splitlines()) == 1 and "--k 0" in err and "--sink 0" in err and "--window 0" in err
    assert "no step reads a block" in err
    with pytest.raises(UserError, match="no step reads a block"):
        SparseSpec(steps=5, k=0, sink=0, window=0)
    SparseSpec(steps=5, k=0, sink=1, window=0)  # one of them is enough
