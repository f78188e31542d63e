"""Probe r13: defects found in the review of d3f3afa..bd642ee."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_ABANDONING_TEST = '''
import warnings
from tiercache.data.remote_guard import abandon_client

def test_abandons_a_client():
    abandon_client(object(), ())  # as RemoteStore.close does with a client of a hung master
    warnings.warn("a late warning", UserWarning)
    assert {ok}
'''


def _pytest_rc(folder: Path, ok: bool, *args: str) -> int:
    folder.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", folder / "conftest.py")
    (folder / "test_abandon.py").write_text(_ABANDONING_TEST.format(ok=ok))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(folder), *args, "test_abandon.py"]
    return subprocess.run(argv, cwd=folder, env=env, capture_output=True, timeout=300).returncode


def test_the_process_exits_with_pytests_final_status_after_a_client_was_abandoned(tmp_path):
    assert _pytest_rc(tmp_path / "warned", True, "--max-warnings", "0") == 6  # set after sessionfinish's argument
    assert _pytest_rc(tmp_path / "failed", False) == 1
    assert _pytest_rc(tmp_path / "passed", True) == 0
