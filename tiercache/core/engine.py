"""Transfer-engine contract and the immediate engine used by pure-metadata runs.

An engine executes ``TransferPlan``s and decides nothing. ``submit`` returns at once;
``poll`` returns finished jobs; ``wait`` blocks until one job is finished. The manager
applies results on its own thread; engines never touch metadata.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol, Sequence

from .plans import JobResult, TransferPlan

__all__ = ["TransferEngine", "ImmediateEngine", "coalesced"]


class TransferEngine(Protocol):
    """What the manager needs from an engine."""

    def submit(self, plan: TransferPlan) -> None:
        """Starts executing ``plan``; returns at once."""

    def poll(self) -> list[JobResult]:
        """Results of jobs finished since the last poll (never blocks)."""

    def wait(self, job_id: int) -> JobResult:
        """Blocks until ``job_id`` has finished and returns its result (not returned by poll)."""

    def fill(self, tier: int, ids: Sequence[int], slots: Sequence[int]) -> None:
        """Writes the bytes of newly computed blocks ``ids`` into ``slots`` of ``tier``.

        The slots are reserved, not yet published: the manager publishes the blocks only
        after ``fill`` returns, and releases the slots if it raises (nothing is placed).
        """

    def discard(self, tier: int, ids: Sequence[int], slots: Sequence[int]) -> None:
        """Forgets the stored bytes of ``ids`` (left ``tier``); a durable tier deletes them."""

    # Optional: ``coalesce()``, a context manager within which an engine that models costs
    # charges the transfers and fills it is given as one per link (``coalesced``).


def coalesced(engine: TransferEngine) -> AbstractContextManager:
    """``engine.coalesce()``: the transfers and fills made within are charged as one per link
    (``SimEngine.coalesce``), as one placement of the same blocks would be. An engine without
    it (one that moves bytes: it costs what it costs) is left as it is."""
    coalesce = getattr(engine, "coalesce", None)
    return nullcontext() if coalesce is None else coalesce()


class ImmediateEngine:
    """Completes every plan at once, moving no bytes; for metadata-only use and tests.

    ``fail_next`` makes the next ``n`` submitted jobs fail (fault injection).
    """

    def __init__(self) -> None:
        self._done: dict[int, JobResult] = {}
        self.fail_next = 0
        self.submitted = 0

    def submit(self, plan: TransferPlan) -> None:
        self.submitted += 1
        if self.fail_next > 0:
            self.fail_next -= 1
            self._done[plan.job_id] = JobResult(plan.job_id, "injected failure")
        else:
            self._done[plan.job_id] = JobResult(plan.job_id)

    def poll(self) -> list[JobResult]:
        done, self._done = list(self._done.values()), {}
        return done

    def wait(self, job_id: int) -> JobResult:
        return self._done.pop(job_id)

    def fill(self, tier: int, ids: Sequence[int], slots: Sequence[int]) -> None:
        """No bytes to write."""

    def discard(self, tier: int, ids: Sequence[int], slots: Sequence[int]) -> None:
        """No bytes to forget."""
