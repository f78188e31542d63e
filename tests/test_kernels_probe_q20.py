"""Probe Q20, finding 1: ``ArrayTierManager("lfu", ...)`` with the default ``max_count`` wrote
past its arrays (an LFU count indexes the bucket rows of ``P``, which numba does not bounds-check)
when an id was hit more often than the rows allow, through ``access`` and an untrusted ``run``
alike: the process died with SIGSEGV. The scenarios run in a child process, so that a crash is
a failed test, not a dead test run."""

from __future__ import annotations

import json
import subprocess
import sys

SCENARIO = r'''
import json
import numpy as np
from tiercache.sim.array_manager import ArrayTierManager

out = {}
one = ArrayTierManager("lfu", ("hbm",), (2,), 3)  # max_count 1: counts up to max(3, 1 + 2) = 3 fit
try:
    for _ in range(40):
        one.access(np.array([0]))
except ValueError as exc:
    out["access"] = str(exc)
one.check_invariants()
out["access_hits"] = one.stats().tiers[0].hits
one.access(np.array([1]))  # other ids still go in
out["resident"] = [one.locate(i) for i in range(3)]

ids, nus, offsets = np.zeros(200, np.int32), np.zeros(200, np.int64), np.arange(201, dtype=np.int64)
two = ArrayTierManager("lfu", ("hbm", "dram"), (2, 2), 3)
try:
    two.run(ids, nus, offsets, 0, 200, False, np.zeros(200, np.int64))
except ValueError as exc:
    out["run"] = str(exc)
two.check_invariants()
out["run_hits"] = two.stats().tiers[0].hits

sized = ArrayTierManager("lfu", ("hbm", "dram"), (2, 2), 3, 200)  # max_count as replay passes it
sized.run(ids, nus, offsets, 0, 200, False, np.zeros(200, np.int64))
sized.check_invariants()
out["sized_hits"] = sized.stats().tiers[0].hits
print(json.dumps(out))
'''


def test_an_lfu_access_that_would_count_past_the_managers_arrays_is_refused_naming_the_id_never_a_crash():
    done = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    out = json.loads(done.stdout)
    assert out["access"] == ("access: block 0 could reach LFU count 4, past the 3 this manager's arrays hold "
                             "(max(n_ids, max_count + 2) with n_ids 3, max_count 1: give max_count the most "
                             "accesses of any one id)")
    assert out["access_hits"] == 2  # three accesses went in (a miss, two hits); the fourth changed nothing
    assert out["resident"] == [0, 0, None]
    assert out["run"].startswith("run: block 0 could reach LFU count 200 in requests 0..200, past the 3 ")
    assert out["run_hits"] == 0  # refused before any request ran
    assert out["sized_hits"] == 199
