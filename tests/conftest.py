"""Shared fixtures: the bundled sample trace and small managers."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
SAMPLE_TRACE = DATA / "mooncake_synthetic_trace.jsonl"


def sample_requests(path: Path = SAMPLE_TRACE) -> list[list[int]]:
    """The ``hash_ids`` of every request of a Mooncake trace, in order."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line)["hash_ids"] for line in handle if line.strip()]


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
