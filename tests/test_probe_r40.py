"""Review R40 findings outside the router (those are in ``test_fleet_router.py``):

- R40-4: ``stack_distances([0.5, 0.7])`` truncated both ids to 0 (one id) where ``next_use``
  takes them as two; ``distance_counts``' ``following`` as a list or floats worked without
  numba and failed with numba's raw errors.
- R40-5: running out of memory while the CLI's modules load (numba, llvmlite) ended in a
  traceback, although README promises one line for a ``MemoryError``.
"""

from __future__ import annotations

import builtins

import numpy as np
import pytest

import tiercache.__main__ as entry
from tiercache.policies.base import NO_NEXT_USE
from tiercache.sim import mrc
from tiercache.sim.traces import next_use

PATHS = [pytest.param(True, id="numba"), pytest.param(False, id="numpy")]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param and not mrc.HAVE_NUMBA:
        pytest.skip("numba not installed")
    monkeypatch.setattr(mrc, "HAVE_NUMBA", request.param)
    return request.param


@pytest.mark.parametrize("ids", [[0.5, 0.7], np.array([1.0, 2.0]), np.array([1 + 0j]), ["a", "b"]])
def test_ids_that_are_not_integers_are_refused_on_both_paths(path, ids):
    with pytest.raises(ValueError, match="ids must be integers, got dtype"):
        mrc.stack_distances(ids)
    with pytest.raises(ValueError, match="ids must be integers, got dtype"):
        mrc.distance_counts(ids)


def test_integer_ids_of_every_kind_give_the_int64_answer(path):
    ids = np.array([3, 1, 3, 2, 1, 3])
    want = mrc.stack_distances(ids.astype(np.int64))
    for kind in (np.int8, np.uint16, np.int32, np.uint64):
        assert np.array_equal(mrc.stack_distances(ids.astype(kind)), want)
    assert np.array_equal(mrc.stack_distances([True, False, True]), [0, 0, 2])
    assert mrc.stack_distances([]).size == 0


def test_following_given_as_a_list_or_narrow_ints_counts_alike_on_both_paths(path):
    rng = np.random.default_rng(40)
    ids = rng.integers(0, 30, 400)
    following = next_use(ids)
    want = mrc.distance_counts(ids)
    assert np.array_equal(mrc.distance_counts(ids, following=list(following)), want)
    narrow = np.where(following == NO_NEXT_USE, -1, following).astype(np.int32)  # -1: no next access too
    assert np.array_equal(mrc.distance_counts(ids, following=narrow), want)
    with pytest.raises(ValueError, match="following must be integers, got dtype float64"):
        mrc.distance_counts(ids, following=following.astype(float))


def _failing_import(monkeypatch, error: BaseException) -> None:
    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "tiercache.cli":
            raise error
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)


def _unmapped() -> OSError:
    try:
        raise OSError("/x/libllvmlite.so: failed to map segment from shared object")
    except OSError:
        try:
            raise OSError("Could not find/load shared object file 'libllvmlite.so'")
        except OSError as outer:
            return outer


def _unmapped_numpy() -> ImportError:
    """numpy's form (review R41-4): an ImportError whose long text quotes the loader's."""
    return ImportError("Error importing numpy ...\n\nOriginal error was: libscipy_openblas64_.so: failed to map "
                       "segment from shared object\n")


@pytest.mark.parametrize("error", [MemoryError(), _unmapped(), _unmapped_numpy()],
                         ids=["MemoryError", "unmapped library", "unmapped numpy library"])
def test_out_of_memory_while_the_cli_loads_ends_in_one_line(monkeypatch, capsys, error):
    _failing_import(monkeypatch, error)
    assert entry.run() == 1
    err = capsys.readouterr().err
    assert err.startswith("tiercache: error: out of memory while loading") and err.count("\n") == 1


def test_any_other_error_while_the_cli_loads_is_not_called_out_of_memory(monkeypatch):
    _failing_import(monkeypatch, OSError("libfoo.so: cannot open shared object file"))
    with pytest.raises(OSError, match="cannot open shared object"):
        entry.run()
