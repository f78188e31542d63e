"""The live transfer engine: executes the manager's plans on real bytes.

``LocalEngine`` decides nothing and never touches metadata. Each plan is started by the copy
handler registered for its (source medium, destination medium) pair (``handlers.py``): a CUDA
copy stream with one event per job, NVMe I/O threads, or an inline host copy. The engine
tracks the jobs until they settle and hands their results to the manager (``poll``/``wait``),
which applies them on its own thread. It also writes new blocks (``fill``) and forgets the
stored bytes of blocks that left a tier (``discard``), through the media's own methods.

In-flight work is bounded: ``submit`` settles the oldest job once ``max_inflight`` run.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np
import torch

from tiercache.core.plans import JobResult, TransferPlan

from .handlers import CopyContext, CopyHandler, Job, handler_for
from .nvme_results import ReadIOError
from .pools import BlockPool

__all__ = ["LocalEngine"]


class LocalEngine:
    """Moves blocks between media (``BlockPool`` tiers, an ``NVMeStore`` tier, ...).

    Args:
        tiers: one medium (``media.Medium``) per tier, fastest first.
        key_of: the content key of a block id (read-only view of the store's key map).
        max_inflight: jobs running at once before ``submit`` settles the oldest.
        staging_blocks: pinned host blocks used to move GPU blocks to and from NVMe.
    """

    def __init__(self, tiers: Sequence[object], key_of: Callable[[int], bytes], max_inflight: int = 8,
                 staging_blocks: int = 64) -> None:
        self.tiers = list(tiers)
        self._key_of = key_of
        self._max_inflight = max_inflight
        self._jobs: OrderedDict[int, Job] = OrderedDict()
        self._done: dict[int, JobResult] = {}  # settled early (to bound work), not yet returned
        self._staged: dict[int, torch.Tensor] = {}
        self._handlers: dict[tuple[int, int], CopyHandler] = {}
        self._ctx = _copy_context(self.tiers, key_of, staging_blocks, self._settle_all)

    @property
    def cuda(self) -> bool:
        """True when copies run on CUDA streams (a tier lives on a GPU)."""
        return self._ctx.h2d_stream is not None

    # -- new and dropped bytes -----------------------------------------------------------
    def stage(self, ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Holds the bytes of blocks about to be inserted until the manager places them."""
        for index, block_id in enumerate(ids):
            self._staged[block_id] = blocks[index]

    def unstage(self, ids: Sequence[int]) -> None:
        """Forgets staged bytes that were not placed (refused, or already resident)."""
        for block_id in ids:
            self._staged.pop(block_id, None)

    def fill(self, tier: int, ids: Sequence[int], slots: Sequence[int]) -> None:
        """Writes staged bytes of ``ids`` into reserved ``slots`` of ``tier``."""
        # Read, not pop: an id can be placed twice in one access (evicted, then missed again);
        # the caller's unstage clears the bytes once the access is over.
        blocks = torch.stack([self._staged[block_id] for block_id in ids])
        self.tiers[tier].write(np.asarray(slots, dtype=np.int64), blocks)

    def discard(self, tier: int, ids: Sequence[int], slots: Sequence[int]) -> None:
        """Forgets the stored bytes of ``ids``, which left ``tier`` (a durable medium deletes
        them; a pool just reuses the slots)."""
        medium = self.tiers[tier]
        if len(ids):
            medium.forget(self._ctx.keys(ids) if medium.keyed else [])

    # -- plans ---------------------------------------------------------------------------
    def submit(self, plan: TransferPlan) -> None:
        """Starts ``plan``; returns once it is queued (waits only to bound in-flight jobs)."""
        while len(self._jobs) >= self._max_inflight:
            self._settle_early(next(iter(self._jobs)))
        src, dst = self.tiers[plan.src_tier], self.tiers[plan.dst_tier]
        self._jobs[plan.job_id] = self._handler(plan.src_tier, plan.dst_tier).start(plan, src, dst, self._ctx)

    def poll(self) -> list[JobResult]:
        """Results of finished jobs, in submission order; never blocks."""
        done = [job_id for job_id, job in self._jobs.items() if _finished(job)]
        results = [self._settle(job_id) for job_id in done]
        early, self._done = list(self._done.values()), {}
        return early + results

    def wait(self, job_id: int) -> JobResult:
        """Blocks until ``job_id`` is done and returns its result."""
        if job_id in self._done:
            return self._done.pop(job_id)
        return self._settle(job_id)

    def event_of(self, job_id: int):
        """The CUDA event of an in-flight pool copy (None on the CPU or once settled), so a
        compute stream can ``wait_event`` on exactly the layer it needs instead of syncing."""
        job = self._jobs.get(job_id)
        return None if job is None else job.event

    @property
    def inflight(self) -> int:
        """Jobs submitted and not yet returned (the queue depth)."""
        return len(self._jobs) + len(self._done)

    # -- completion ----------------------------------------------------------------------
    def _handler(self, src: int, dst: int) -> CopyHandler:
        handler = self._handlers.get((src, dst))
        if handler is None:
            handler = self._handlers[(src, dst)] = handler_for(self.tiers[src], self.tiers[dst])
        return handler

    def _settle_all(self) -> None:
        for job_id in list(self._jobs):
            self._settle_early(job_id)

    def _settle_early(self, job_id: int) -> None:
        """Finishes a job before its owner asks; its result waits in ``_done`` for poll/wait."""
        self._done[job_id] = self._settle(job_id)

    def _settle(self, job_id: int) -> JobResult:
        """Waits for a job and forgets it. An interrupt (Ctrl-C) while waiting leaves the job
        here: its copy still runs on its thread or stream, into slots the manager keeps
        reserved, and a later wait settles it (forgetting it would let the manager free a slot
        the copy is still writing)."""
        job = self._jobs[job_id]
        try:
            result = self._outcome(job_id, job)
        except KeyboardInterrupt:
            raise  # the job stays: its copy still runs
        except BaseException:
            del self._jobs[job_id]  # the job itself failed: as before, it is gone
            raise
        del self._jobs[job_id]
        return result

    def _outcome(self, job_id: int, job: Job) -> JobResult:
        if job.result is not None:
            return job.result
        if job.event is not None:
            job.event.synchronize()
            return JobResult(job_id)
        try:
            outcome = job.future.result()
        except OSError as exc:  # the move failed; its sources stay unless proven lost
            return JobResult(job_id, f"I/O error: {exc}", self._proven_lost(job.plan, exc))
        return job.finish(outcome)

    def _proven_lost(self, plan: TransferPlan, exc: OSError) -> tuple[int, ...]:
        """Source blocks of a failed ``plan`` that its reads proved absent or corrupt. A
        block whose read merely failed (``ReadIOError.failed``) is not lost: it stays stored."""
        if not isinstance(exc, ReadIOError) or not exc.lost_keys:
            return ()
        return tuple(b for b, key in zip(plan.ids, self._ctx.keys(plan.ids)) if key in exc.lost_keys)


def _finished(job: Job) -> bool:
    if job.result is not None:
        return True
    if job.future is not None:
        return job.future.done()
    return job.event.query()


def _copy_context(tiers: list, key_of: Callable[[int], bytes], staging_blocks: int, settle_all) -> CopyContext:
    """Streams and staging for the media: CUDA ones when a tier lives on a GPU."""
    gpu = [t for t in tiers if isinstance(getattr(t, "device", None), torch.device) and t.device.type == "cuda"]
    if not gpu:
        return CopyContext(key_of, None, None, None, settle_all)
    device = gpu[0].device
    # One copy stream per direction, so host-to-device fetches never queue behind
    # device-to-host write-backs (PCIe is full duplex).
    staging = BlockPool(gpu[0].layout, staging_blocks, "cpu", pin_memory=True)
    return CopyContext(key_of, torch.cuda.Stream(device=device), torch.cuda.Stream(device=device), staging, settle_all)
