"""Review R39: out of memory seen through numba, and next uses written with -1 for none.

1. numba, out of memory while it loads a cached kernel, raised ``SystemError`` (its context a
   ``MemoryError``): the command ended in a traceback, not the one-line out-of-memory error.
2. ``mrc.distance_counts(ids, following=...)`` took -1 for "no next access" on the compiled
   path (as ``stackdist.next_positions`` writes it) and misread it on the numpy path, where a
   -1 indexed the last access.
"""

from __future__ import annotations

import numpy as np
import pytest

from tiercache.cli import main
from tiercache.sim import mrc


def _trace(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n')
    return str(trace)


def _failing_load(monkeypatch, error: BaseException):
    from tiercache.cli import tracefile

    def load(*args, **kwargs):
        raise error

    monkeypatch.setattr(tracefile, "load_trace_cached", load, raising=False)
    monkeypatch.setattr(tracefile, "load_trace", load, raising=False)


def test_a_system_error_raised_while_out_of_memory_ends_in_one_line(monkeypatch, capsys, tmp_path):
    def exhausted():
        try:
            raise MemoryError
        except MemoryError:
            raise SystemError("error return without exception set")  # noqa: B904 - numba's shape

    try:
        exhausted()
    except SystemError as exc:
        error = exc
    _failing_load(monkeypatch, error)
    assert main(["trace", "inspect", _trace(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: out of memory" in err, err


def test_any_other_system_error_is_not_called_out_of_memory(monkeypatch, tmp_path):
    _failing_load(monkeypatch, SystemError("something else"))
    with pytest.raises(SystemError, match="something else"):
        main(["trace", "inspect", _trace(tmp_path)])


@pytest.mark.parametrize("numba", [True, False])
def test_minus_one_means_no_next_access_on_both_paths(monkeypatch, numba):
    if numba and not mrc.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    if not numba:
        monkeypatch.setattr(mrc, "HAVE_NUMBA", False)
    ids = np.array([0, 1, 0, 1])
    assert mrc.distance_counts(ids, following=np.array([2, 3, -1, -1])).tolist() == [2, 0, 2]
    assert mrc.distance_counts(ids).tolist() == [2, 0, 2]
