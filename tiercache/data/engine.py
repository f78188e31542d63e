"""The live transfer engine: executes the manager's plans on real bytes.

``LocalEngine`` decides nothing and never touches metadata. It runs three kinds of plans:

* pool -> pool (HBM <-> DRAM): on CUDA, on a dedicated copy stream with one event per job
  (the compute side waits on the event, never a host sync per block); on the CPU, at once;
* pool -> NVMe and NVMe -> pool: the NVMe store's I/O threads, reading and writing the pool's
  slot views directly (no bounce copy) when the pool is host memory, and through a
  preallocated pinned staging pool when it is on a GPU;
* ``fill`` (new bytes into a top-tier slot) and ``discard`` (delete a block's stored bytes).

In-flight work is bounded: ``submit`` waits for the oldest job once ``max_inflight`` run.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from tiercache.core.plans import JobResult, TransferPlan

from .nvme import NVMeStore
from .pools import BlockPool

__all__ = ["LocalEngine"]


@dataclass
class _Job:
    """One submitted plan: a future (NVMe I/O), a CUDA event, or an immediate result."""

    plan: TransferPlan
    future: Future | None = None
    event: object | None = None
    result: JobResult | None = None


class LocalEngine:
    """Moves blocks between ``BlockPool`` tiers and an ``NVMeStore`` tier.

    Args:
        tiers: one ``BlockPool`` or ``NVMeStore`` per tier, fastest first.
        key_of: the NVMe key of a block id (read-only view of the store facade's key map).
        max_inflight: jobs running at once before ``submit`` waits for the oldest.
        staging_blocks: pinned host blocks used to move GPU blocks to and from NVMe.
    """

    def __init__(self, tiers: Sequence[BlockPool | NVMeStore], key_of: Callable[[int], bytes], max_inflight: int = 8,
                 staging_blocks: int = 64, on_discard: Callable[[Sequence[int]], None] | None = None) -> None:
        self.tiers = list(tiers)
        self._key_of = key_of
        self._on_discard = on_discard
        self._max_inflight = max_inflight
        self._jobs: OrderedDict[int, _Job] = OrderedDict()
        self._done: dict[int, JobResult] = {}  # settled early (to bound work), not yet returned
        self._staged: dict[int, torch.Tensor] = {}
        gpu = [t for t in self.tiers if isinstance(t, BlockPool) and t.device.type == "cuda"]
        # One copy stream per direction, so host-to-device fetches never queue behind
        # device-to-host write-backs (PCIe is full duplex).
        self._stream = torch.cuda.Stream(device=gpu[0].device) if gpu else None  # H2D
        self._d2h_stream = torch.cuda.Stream(device=gpu[0].device) if gpu else None
        layout = self.tiers[0].layout
        self._staging = BlockPool(layout, staging_blocks, "cpu", pin_memory=True) if gpu else None

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
        """Writes staged bytes of ``ids`` into ``slots`` of a pool tier."""
        # Read, not pop: an id can be placed twice in one access (evicted, then missed again);
        # the caller's unstage clears the bytes once the access is over.
        blocks = torch.stack([self._staged[block_id] for block_id in ids])
        self.tiers[tier].write(np.asarray(slots, dtype=np.int64), blocks)

    def discard(self, tier: int, ids: Sequence[int], slots: Sequence[int]) -> None:
        """Deletes NVMe copies of blocks that left the NVMe tier; pool slots are just reused."""
        store = self.tiers[tier]
        if isinstance(store, NVMeStore) and len(ids):
            store.delete([self._key_of(block_id) for block_id in ids])
        if self._on_discard is not None:
            self._on_discard(ids)

    # -- plans ---------------------------------------------------------------------------
    def submit(self, plan: TransferPlan) -> None:
        """Starts ``plan``; returns once it is queued (waits only to bound in-flight jobs)."""
        while len(self._jobs) >= self._max_inflight:
            self._settle_early(next(iter(self._jobs)))
        src, dst = self.tiers[plan.src_tier], self.tiers[plan.dst_tier]
        if isinstance(src, BlockPool) and isinstance(dst, BlockPool):
            job = self._pool_copy(plan, src, dst)
        elif isinstance(dst, NVMeStore):
            job = self._to_store(plan, src, dst)
        else:
            job = self._from_store(plan, src, dst)
        self._jobs[plan.job_id] = job

    def poll(self) -> list[JobResult]:
        """Results of finished jobs, in submission order; never blocks."""
        done = [job_id for job_id, job in self._jobs.items() if self._finished(job)]
        results = [self._settle(job_id) for job_id in done]
        early, self._done = list(self._done.values()), {}
        return early + results

    def wait(self, job_id: int) -> JobResult:
        """Blocks until ``job_id`` is done and returns its result."""
        if job_id in self._done:
            return self._done.pop(job_id)
        return self._settle(job_id)

    @property
    def inflight(self) -> int:
        """Jobs submitted and not yet returned (the queue depth)."""
        return len(self._jobs) + len(self._done)

    # -- pool <-> pool -------------------------------------------------------------------
    def _pool_copy(self, plan: TransferPlan, src: BlockPool, dst: BlockPool) -> _Job:
        if self._stream is None:
            src.copy_to(dst, plan.src_slots, plan.dst_slots, non_blocking=False)
            return _Job(plan, result=JobResult(plan.job_id))
        stream = self._stream if dst.device.type == "cuda" else self._d2h_stream
        # The copy stream must see every write the compute stream queued into the source
        # slots (a fill or a kernel); without this wait it could copy stale bytes.
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            src.copy_to(dst, plan.src_slots, plan.dst_slots, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return _Job(plan, event=event)

    def event_of(self, job_id: int):
        """The CUDA event of an in-flight pool copy (None on the CPU or once settled), so a
        compute stream can ``wait_event`` on exactly the layer it needs instead of syncing."""
        job = self._jobs.get(job_id)
        return None if job is None else job.event

    # -- pool <-> NVMe -------------------------------------------------------------------
    def _to_store(self, plan: TransferPlan, src: BlockPool, store: NVMeStore) -> _Job:
        keys = [self._key_of(block_id) for block_id in plan.ids]
        if src.device.type != "cpu":
            return _Job(plan, result=self._staged_put(plan, keys, src, store))
        views = [src.view(int(slot)) for slot in plan.src_slots]
        return _Job(plan, future=store.submit_put(keys, views, slots=plan.dst_slots.tolist()))

    def _from_store(self, plan: TransferPlan, store: NVMeStore, dst: BlockPool) -> _Job:
        keys = [self._key_of(block_id) for block_id in plan.ids]
        if dst.device.type != "cpu":
            return _Job(plan, result=self._staged_get(plan, keys, store, dst))
        views = [dst.view(int(slot)) for slot in plan.dst_slots]
        return _Job(plan, future=store.submit_get(keys, views))

    def _pieces(self, n: int) -> list[tuple[int, int]]:
        """Staging-sized ``(start, count)`` pieces of an n-block GPU<->NVMe job.

        Staging is reused piece by piece: every in-flight job is settled first, so none
        still reads it.
        """
        for job_id in list(self._jobs):
            self._settle_early(job_id)
        step = self._staging.capacity
        return [(a, min(step, n - a)) for a in range(0, n, step)]

    def _staged_put(self, plan: TransferPlan, keys: list[bytes], src: BlockPool, store: NVMeStore) -> JobResult:
        """GPU -> NVMe through the pinned staging pool, one staging-sized piece at a time."""
        for a, n in self._pieces(len(keys)):
            src.copy_to(self._staging, plan.src_slots[a : a + n], np.arange(n), non_blocking=False)
            views = [self._staging.view(i) for i in range(n)]
            results = store.put(keys[a : a + n], views, slots=plan.dst_slots[a : a + n].tolist())
            failed = [r for r in results if not r.ok]
            if failed:  # the plan fails whole: take back what landed
                store.delete(keys[:a] + [r.key for r in results if r.ok])
                return JobResult(plan.job_id, f"write failed: {failed[0].error}")
        return JobResult(plan.job_id)

    def _staged_get(self, plan: TransferPlan, keys: list[bytes], store: NVMeStore, dst: BlockPool) -> JobResult:
        """NVMe -> GPU through the pinned staging pool; unreadable blocks are reported lost."""
        lost: list[int] = []
        for a, n in self._pieces(len(keys)):
            hits = store.get(keys[a : a + n], [self._staging.view(i) for i in range(n)])
            lost.extend(b for b, ok in zip(plan.ids[a : a + n], hits.tolist()) if not ok)
            if not lost:
                self._staging.copy_to(dst, np.arange(n), plan.dst_slots[a : a + n], non_blocking=False)
        if lost:
            return JobResult(plan.job_id, f"{len(lost)} block(s) unreadable (corrupt or missing)", tuple(lost))
        return JobResult(plan.job_id)

    # -- completion ----------------------------------------------------------------------
    @staticmethod
    def _finished(job: _Job) -> bool:
        if job.result is not None:
            return True
        if job.future is not None:
            return job.future.done()
        return job.event.query()

    def _settle_early(self, job_id: int) -> None:
        """Finishes a job before its owner asks; its result waits in ``_done`` for poll/wait."""
        self._done[job_id] = self._settle(job_id)

    def _settle(self, job_id: int) -> JobResult:
        job = self._jobs.pop(job_id)
        if job.result is not None:
            return job.result
        if job.event is not None:
            job.event.synchronize()
            return JobResult(job_id)
        return self._io_result(job)

    def _io_result(self, job: _Job) -> JobResult:
        """Turns an NVMe future's outcome into a JobResult; unreadable sources are ``lost``."""
        try:
            outcome = job.future.result()
        except OSError as exc:
            return JobResult(job.plan.job_id, f"I/O error: {exc}")
        if isinstance(outcome, np.ndarray):  # a read: a hit mask
            lost = tuple(b for b, ok in zip(job.plan.ids, outcome.tolist()) if not ok)
            if lost:
                return JobResult(job.plan.job_id, f"{len(lost)} block(s) unreadable (corrupt or missing)", lost)
            return JobResult(job.plan.job_id)
        failed = [r for r in outcome if not r.ok]
        if failed:
            # The plan fails as a whole: take back the blocks that did land, so no store
            # entry outlives the manager's decision that these slots stay free.
            self.tiers[job.plan.dst_tier].delete([r.key for r in outcome if r.ok])
            return JobResult(job.plan.job_id, f"write failed: {failed[0].error}")
        return JobResult(job.plan.job_id)
