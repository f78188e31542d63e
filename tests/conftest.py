"""Shared fixtures: the bundled sample trace and small managers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
SAMPLE_TRACE = DATA / "mooncake_synthetic_trace.jsonl"
#: The test session, kept for ``pytest_unconfigure`` to read its final exit status.
SESSION = pytest.StashKey[pytest.Session]()
#: This test process's temporary folder: every ``tempfile`` folder and file a test or the code
#: under test makes (stores, scratch folders, pytest's ``tmp_path``) lands inside it, and
#: ``pytest_unconfigure`` removes it, so a run leaves nothing in the system's temporary folder
#: however a test ends. Set as ``TMPDIR`` too, so commands run as subprocesses use it. To
#: keep a failed test's ``tmp_path`` files for a look, run with ``--basetemp DIR``.
SCRATCH = tempfile.mkdtemp(prefix="tiercache-tests-")
tempfile.tempdir = SCRATCH
os.environ["TMPDIR"] = SCRATCH
#: The binary trace cache the commands under test read through (``tiercache.cli.tracefile``):
#: a folder of this test process, never the user's ``~/.cache``. Set in the environment, so
#: commands run as subprocesses use it too.
TRACE_CACHE = tempfile.mkdtemp(prefix="tiercache-test-traces-")
os.environ["TIERCACHE_TRACE_CACHE"] = TRACE_CACHE


#: Most test worker processes (``-n auto`` in pyproject.toml): each imports torch and
#: transformers (about 1 GiB), and past 4 the suite's longest files set its time anyway.
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per CPU this process may run on, at most ``MAX_WORKERS``."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def pytest_sessionstart(session) -> None:
    session.config.stash[SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """Ends the test process at once, with pytest's status, when a test abandoned a Mooncake
    client: Mooncake's exit handler would tear each one down against its stopped master
    (7-18 s apiece, about 50 s for the suite) and can end in SIGABRT. Runs after every other
    plugin's ``unconfigure``, so reports are written; README documents that exit cost.

    The status is ``session.exitstatus`` as it stands now, after every ``sessionfinish`` hook:
    pytest changes it after the status those hooks receive (``--max-warnings`` sets 6, a
    ``pytest.exit`` in a ``sessionfinish`` hook its own code), and the process must exit with
    the status pytest itself would have returned."""
    shutil.rmtree(SCRATCH, ignore_errors=True)
    guard = sys.modules.get("tiercache.data.remote_guard")
    if guard is not None and guard.abandoned_count() and SESSION in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(config.stash[SESSION].exitstatus))


def sample_requests(path: Path = SAMPLE_TRACE) -> list[list[int]]:
    """The ``hash_ids`` of every request of a Mooncake trace, in order."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line)["hash_ids"] for line in handle if line.strip()]


@pytest.fixture(autouse=True)
def python_default_ctrl_c():
    """Every test runs under Python's default SIGINT handler, as an interactive process does: a
    process started in the background by a non-interactive shell (``cmd &``) inherits SIGINT
    ignored, Python then installs no handler, and the Ctrl-C tests would find it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def sample_trace() -> Path:
    return SAMPLE_TRACE


@pytest.fixture(scope="session")
def requests_sample() -> list[list[int]]:
    return sample_requests()


def run_threads(worker, count: int, timeout: float) -> None:
    """Runs ``worker(index)`` on ``count`` threads and fails if any is still alive after
    ``timeout`` seconds (a deadlock)."""
    threads = [threading.Thread(target=worker, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "deadlock"


def kill_at_random(argv: list[str], rng, delay: tuple[float, float], first_timeout: float = 120) -> list[str]:
    """Runs ``argv``, waits for its first complete output line, then ``rng.uniform(*delay)``
    seconds more, kills it with SIGKILL and returns every complete line it printed (a line
    cut by the kill says nothing)."""
    import signal
    import subprocess
    import time

    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    first = threading.Event()

    def drain() -> None:
        for line in child.stdout:
            if line.endswith("\n"):
                lines.append(line.strip())
            first.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        assert first.wait(first_timeout), f"the child printed nothing: {child.stderr.read() if child.poll() is not None else ''}"
        time.sleep(rng.uniform(*delay))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        reader.join(10)
    assert child.returncode == -signal.SIGKILL, f"the child ended by itself: {child.stderr.read()}"
    return lines


def random_request_trace(path: Path, requests: int, ids: int, seed: int, longest: int = 8) -> Path:
    """A Mooncake JSONL trace at ``path``: ``requests`` requests of 1 to ``longest`` blocks drawn
    from ``ids`` ids (seeded), so a small hierarchy evicts at once."""
    import random

    rng = random.Random(seed)
    with path.open("w") as f:
        for r in range(requests):
            blocks = [rng.randint(0, ids - 1) for _ in range(rng.randint(1, longest))]
            f.write(json.dumps({"timestamp": r, "input_length": 512 * len(blocks), "output_length": 1, "hash_ids": blocks}) + "\n")
    return path


@contextmanager
def module_on_path(folder: Path, name: str, source: str):
    """Writes ``source`` as module ``name`` in ``folder`` and puts ``folder`` on ``sys.path``
    (forked sweep workers inherit it); afterwards the folder and the module are gone again."""
    (folder / f"{name}.py").write_text(source)
    sys.path.insert(0, str(folder))
    try:
        yield name
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(name, None)
