"""Probe q16: README.md read as a user's contract (what it promises the sweep's workers and the
analysis scripts do)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiercache.policies.kernels import HAVE_NUMBA

ROOT = Path(__file__).resolve().parent.parent
HEAD = ROOT / "tests" / "data" / "mooncake_head.jsonl"

# Run in a fresh interpreter (no kernel loaded yet): a sweep in two forked workers, noting how
# many compiled signatures the replay's dispatchers hold when the pool starts and when a worker
# begins a run. The on-disk cache is the default one (warm after any earlier test): nothing here
# forces a cold compile.
_SWEEP_IN_WORKERS = textwrap.dedent(f"""
    import multiprocessing
    from tiercache.sim import chain, sweep

    seen = multiprocessing.get_context("fork").RawArray("q", 3)
    real_pool, real_run = sweep.ProcessPoolExecutor, sweep._run_in_worker

    def pool(*args, **kwargs):
        seen[0] = len(chain.run_requests.signatures) * len(chain.init_all.signatures)
        return real_pool(*args, **kwargs)

    def run_in_worker(index, spec):
        seen[1 + index] = len(chain.run_requests.signatures) * len(chain.init_all.signatures)
        return real_run(index, spec)

    sweep.ProcessPoolExecutor, sweep._run_in_worker = pool, run_in_worker
    doc = sweep.run_sweep({str(HEAD)!r}, ["lru", "arc"], [100], ["prefix"], workers=2)
    assert len(doc["runs"]) == 2
    print(list(seen))
""")


@pytest.mark.skipif(not HAVE_NUMBA, reason="the replay kernels need numba")
def test_a_sweep_compiles_its_kernels_once_in_the_parent_and_no_worker_compiles_them() -> None:
    done = subprocess.run([sys.executable, "-c", _SWEEP_IN_WORKERS], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    at_pool, *at_runs = eval(done.stdout.strip().splitlines()[-1])
    assert at_pool >= 1, "the pool was forked before the parent compiled (or loaded) the replay kernels"
    assert all(n >= 1 for n in at_runs), f"a worker began a run with no compiled kernel: {at_runs}"
