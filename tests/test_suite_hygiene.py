"""The test suite cleans up after itself: a run leaves nothing in the system's temporary folder.

Tests make stores, scratch folders and trace caches through ``tempfile``; ``conftest.py`` puts
all of them in one folder of the test process and removes it at the end. Before, every run of
the suite left hundreds of store folders in ``/tmp``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_a_pytest_run_leaves_the_temporary_folder_as_it_found_it(tmp_path):
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(system_tmp)}
    env.pop("TIERCACHE_TRACE_CACHE", None)
    # test_store_probe_q48 makes its stores' folders with a bare tempfile.mkdtemp() and never
    # removes them; test_store_state's machine makes one per example.
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                          str(TESTS / "test_store_probe_q48.py")],
                         env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert sorted(os.listdir(system_tmp)) == []
