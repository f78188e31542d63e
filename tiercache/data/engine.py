"""The live transfer engine: executes the manager's plans on real bytes.

``LocalEngine`` decides nothing and never touches metadata. Each plan is started by the copy
handler registered for its (source medium, destination medium) pair (``handlers.py``): a CUDA
copy stream with one event per job, NVMe I/O threads, or an inline host copy. The engine
tracks the jobs until they settle and hands their results to the manager (``poll``/``wait``),
which applies them on its own thread. It also writes new blocks (``fill``) and forgets the
stored bytes of blocks that left a tier (``discard``), through the media's own methods.

Retained copies (exclusive hierarchy, ``retain_moved_up``): a block that moves up out of a
keyed tier (NVMe) leaves its stored copy there, valid (a key names its content) and durable,
instead of deleting it. So a read followed by a crash, a full disk at close, or a flush the
store needs to recycle slots never makes the deletion of a block's only durable copy
durable while the block is merely being read. The copy is taken up again, with no write,
when the block comes back down (counted per link in ``LocalEngine.taken_up``); it is deleted when the block leaves the hierarchy (or moves
below the tier), when a move into the tier that reserved its last free slots has written its
blocks (oldest first: the store never holds more entries than the tier's capacity once that
move settles; a move whose write fails, a full disk, leaves them retained), or at close
(``RetainedCopies.drop_all``).

In-flight work is bounded: ``submit`` settles the oldest job once ``max_inflight`` run.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np
import torch

from tiercache.core.plans import JobResult, TransferPlan

from .handlers import CopyContext, CopyHandler, Job, handler_for
from .nvme_results import ReadIOError
from .pools import BlockPool

__all__ = ["LocalEngine", "RetainedCopies"]


class RetainedCopies:
    """The stored copies keyed tiers keep of blocks that moved up out of them (see the module
    docstring), and the blocks deleted from such a tier during the current store call.

    Invariants (``check``): a block is retained in a tier at most once, either held (oldest
    first), claimed by the one job in flight that brings it back down (a claim is settled
    exactly once: taken up on success, held again on failure), or displaced by the one job
    in flight whose reservation needs its room (``bound``; settled exactly once: deleted
    once the job's write succeeded, held again if it failed, so a failed write, a full
    disk, never costs a block its durable copy); every held or displaced copy is stored in
    its tier's medium and its block held by the manager in a tier above; once every job has
    settled a tier holds no more copies than the manager has free slots there, so the
    store never holds more entries than the tier's capacity: a reopened store adopts every
    durable entry, and a store-full flush always frees enough. While a job with displaced
    copies runs, no other job into its tier runs (``LocalEngine.submit``), so no flush makes
    its written blocks durable beside the copies they displace.
    """

    def __init__(self, media: Sequence[object], keys: Callable[[Sequence[int]], list[bytes]]) -> None:
        self._media, self._keys = media, keys
        self._locate: Callable[[int], int | None] | None = None  # None: not retaining
        self._free: Callable[[int], int] | None = None
        self._held: dict[int, dict[int, None]] = {}  # tier -> retained block ids, oldest first
        self._claims: dict[int, tuple[int, list[int]]] = {}  # job id -> (tier, ids it takes up)
        self._displaced: dict[int, tuple[int, list[int]]] = {}  # job id -> (tier, copies deleted once it wrote)
        self._left: dict[int, dict[int, int]] = {}  # tier -> {block deleted from it this call: its flush count then}

    def enable(self, locate: Callable[[int], int | None], free: Callable[[int], int]) -> None:
        """Starts retaining: ``locate`` gives the tier a block is held in (None: none),
        ``free`` the manager's free (unreserved) slots of a tier."""
        self._locate, self._free = locate, free

    def moved_out(self, tier: int, ids: Sequence[int]) -> list[int]:
        """``ids`` left ``tier``: retains those held above it now (keyed, unshared tier);
        returns the others, to be deleted (noted as left during this call)."""
        if self._locate is None or getattr(self._media[tier], "shared", False):
            return list(ids)
        up = {block_id for block_id in ids if (where := self._locate(block_id)) is not None and where < tier}
        self._held.setdefault(tier, {}).update(dict.fromkeys(b for b in ids if b in up))
        gone = [block_id for block_id in ids if block_id not in up]
        self._note_left(tier, gone)
        return gone

    def let_go(self, ids: Sequence[int]) -> None:
        """Deletes the held or displaced copies of ``ids`` whose blocks are no longer held above them."""
        for tier, held in list(self._held.items()):
            if held:
                self._delete(tier, [b for b in ids if b in held and not self._above(b, tier)])
        for job_id, (tier, kept) in list(self._displaced.items()):
            if gone := [b for b in ids if b in kept and not self._above(b, tier)]:
                self._displaced[job_id] = (tier, [b for b in kept if b not in gone])
                self._forget(tier, gone)

    def bound(self, tier: int, job_id: int | None = None) -> None:
        """The oldest held copies of ``tier`` beyond the manager's free slots there (called
        once slots are reserved, before anything can flush): deleted now, or, for a job
        (``job_id``), displaced by it: kept until it settles (``settle``)."""
        held = self._held.get(tier)
        extra = list(held)[: max(0, len(held) - self._free(tier))] if held else []
        if job_id is None or not extra:
            self._delete(tier, extra)
            return
        for block_id in extra:
            del held[block_id]
        self._displaced[job_id] = (tier, extra)

    def displaced(self, job_id: int) -> int:
        """How many copies ``job_id`` displaced and still keeps."""
        return len(self._displaced.get(job_id, (0, ()))[1])

    def give_up(self, job_id: int, n: int) -> None:
        """Deletes the ``n`` oldest copies ``job_id`` displaced now, before its write: the
        store has no physical slot for its blocks until their deletion is flushed."""
        tier, kept = self._displaced.pop(job_id)
        if kept[n:]:
            self._displaced[job_id] = (tier, kept[n:])
        self._forget(tier, kept[:n])

    def crowded(self, tier: int) -> bool:
        """True when a job into ``tier`` may displace copies (more held than free slots), or
        one in flight keeps copies it displaced."""
        if self._free is None:
            return False
        return len(self._held.get(tier, ())) > self._free(tier) or any(where == tier for where, _ in self._displaced.values())

    def held_in(self, tier: int) -> list[int]:
        """The blocks whose copies ``tier`` holds now (oldest first); claimed ones excluded."""
        return list(self._held.get(tier, ()))

    def claim(self, job_id: int, tier: int, ids: Sequence[int]) -> set[int]:
        """The ids of a job into ``tier`` whose copies are held there: the job takes them up
        as they are (no write); until it settles they are not deleted by ``bound``."""
        held = self._held.get(tier)
        kept = [block_id for block_id in ids if held and block_id in held]
        for block_id in kept:
            del held[block_id]
        if kept:
            self._claims[job_id] = (tier, kept)
        return set(kept)

    def settle(self, job_id: int, ok: bool) -> int:
        """A job settled: its claimed copies are taken up (``ok``) or held again, the copies
        it displaced deleted (``ok``: its blocks took their room) or held again, oldest
        first; returns how many it took up (blocks that entered the tier with no write)."""
        self._settle_displaced(job_id, ok)
        claim = self._claims.pop(job_id, None)
        if claim is None:
            return 0
        if not ok:
            self._held.setdefault(claim[0], {}).update(dict.fromkeys(claim[1]))
            return 0
        return len(claim[1])

    def _settle_displaced(self, job_id: int, ok: bool) -> None:
        """The copies ``job_id`` displaced: deleted (``ok``, or their blocks left the tiers
        above), else held again as the oldest."""
        tier, displaced = self._displaced.pop(job_id, (0, []))
        back = [] if ok else [block_id for block_id in displaced if self._above(block_id, tier)]
        if back:
            self._held[tier] = {**dict.fromkeys(back), **self._held.get(tier, {})}
        self._forget(tier, [block_id for block_id in displaced if block_id not in back])

    def returned(self, tier: int, ids: Sequence[int]) -> None:
        """``ids`` were written into ``tier`` (before the manager publishes them there). If one
        left it earlier in this call and the store flushed since (to recycle slots: that made
        the departure durable, not the return), the tier is flushed at once, so a crash cannot
        lose a block that is in the tier both before and after the call. A flush that fails
        keeps its batch pending for the next one."""
        left = self._left.get(tier)
        if not left:
            return
        flushed = self._media[tier].stats["flushes"]
        if all([left.pop(block_id, flushed) == flushed for block_id in ids]):  # a list: pops every id
            return
        try:
            self._media[tier].flush()
        except OSError:
            pass  # counted by the store (failed_flushes); the next flush retries the batch

    def end_call(self, arriving: dict[int, set[int]] | None = None) -> None:
        """A store call ended: what left a tier during it is forgotten (a block that is not in
        the tier at the end of a call need not be there after a crash), but for the blocks
        ``arriving`` there (tier -> ids of jobs still in flight into it, ``LocalEngine.end_call``):
        such a job settles in a later call, and its ``returned`` must still see the departure
        so that it flushes (the manager placed the block in the tier at the end of both calls)."""
        if not arriving:
            self._left.clear()
            return
        for tier in list(self._left):
            kept = {block_id: count for block_id, count in self._left[tier].items() if block_id in arriving.get(tier, ())}
            if kept:
                self._left[tier] = kept
            else:
                del self._left[tier]

    def drop_all(self) -> int:
        """Deletes every held copy (closing); returns how many."""
        for job_id in list(self._displaced):
            self._settle_displaced(job_id, False)  # a job still in flight at close: held again, deleted below
        tiers = self._tiers()
        for tier, ids in tiers:
            self._delete(tier, ids)
        return sum(len(ids) for _, ids in tiers)

    def check(self, settled: bool = True) -> None:
        """Asserts the invariants above; the bound only once every move is ``settled`` (a
        failed move's claimed copies are held again before the manager frees its slots)."""
        assert not settled or not self._displaced, f"jobs settled but still displace copies: {self._displaced}"
        for tier, ids in self._tiers():
            assert not settled or len(ids) <= self._free(tier), f"tier {tier} retains {len(ids)} copies, more than its free slots"
            self._check_stored(tier, ids)
        for tier, ids in self._displaced.values():
            assert len(set(ids) & set(self._held.get(tier, ()))) == 0, f"tier {tier}: a displaced copy is also held"
            self._check_stored(tier, ids)

    def _check_stored(self, tier: int, ids: list[int]) -> None:
        """Asserts every copy of ``ids`` is stored in ``tier`` and its block held above it."""
        for block_id, key in zip(ids, self._keys(ids)):
            assert self._above(block_id, tier), f"retained block {block_id} is not held above tier {tier}"
            assert self._media[tier].contains(key), f"retained block {block_id} is not stored in tier {tier}"

    def _tiers(self) -> list[tuple[int, list[int]]]:
        return [(tier, list(held)) for tier, held in self._held.items() if held]

    def _delete(self, tier: int, ids: list[int]) -> None:
        held = self._held.get(tier, {})
        ids = [block_id for block_id in ids if block_id in held]
        for block_id in ids:
            del held[block_id]
        self._forget(tier, ids)

    def _forget(self, tier: int, ids: list[int]) -> None:
        """Deletes the copies of ``ids`` (no longer held nor displaced) from ``tier``'s medium."""
        if ids:
            self._media[tier].forget(self._keys(ids))
            self._note_left(tier, ids)

    def _above(self, block_id: int, tier: int) -> bool:
        """True while the manager holds ``block_id`` in a tier above ``tier``."""
        where = self._locate(block_id)
        return where is not None and where < tier

    def _note_left(self, tier: int, ids: list[int]) -> None:
        """Notes blocks deleted from ``tier`` (a keyed medium counting its flushes in ``stats``)."""
        if ids:
            self._left.setdefault(tier, {}).update(dict.fromkeys(ids, self._media[tier].stats["flushes"]))


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
        settle_all = weakref.WeakMethod(self._settle_all)  # the context is the engine's: no cycle back to it
        self._ctx = _copy_context(self.tiers, key_of, staging_blocks, lambda: settle_all()())
        self.retained = RetainedCopies(self.tiers, self._ctx.keys)
        #: Per (source, destination) tier: blocks whose move settled by taking up the copy the
        #: destination retained (``RetainedCopies``), so nothing crossed the link; only grows.
        self.taken_up: dict[tuple[int, int], int] = {}
        self.already_there: dict[tuple[int, int], int] = {}  # per link: blocks a shared destination already held

    def retain_moved_up(self, locate: Callable[[int], int | None], free: Callable[[int], int]) -> None:
        """Keeps the stored copy of a block that moves up out of a keyed tier (see the module
        docstring and ``RetainedCopies.enable``). Only for an exclusive hierarchy, where a
        block is held in one tier at a time."""
        self.retained.enable(locate, free)

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
        if len(ids) == 1:  # one block (a policy that places one at a time): a view, no copy
            blocks = self._staged[ids[0]].unsqueeze(0)
        else:
            blocks = torch.stack([self._staged[block_id] for block_id in ids])
        self.retained.bound(tier)
        self.tiers[tier].write(np.asarray(slots, dtype=np.int64), blocks)
        self.retained.returned(tier, ids)

    def discard(self, tier: int, ids: Sequence[int], slots: Sequence[int]) -> None:
        """Forgets the stored bytes of ``ids``, which left ``tier`` (a durable medium deletes
        them, unless they moved up and are retained; a pool just reuses the slots). Retained
        copies of ``ids`` whose blocks are no longer above them are deleted."""
        medium = self.tiers[tier]
        if not len(ids):
            return
        if not medium.keyed:
            medium.forget([])
        elif gone := self.retained.moved_out(tier, ids):
            medium.forget(self._ctx.keys(gone))
        self.retained.let_go(ids)

    # -- plans ---------------------------------------------------------------------------
    def submit(self, plan: TransferPlan) -> None:
        """Starts ``plan``; returns once it is queued (waits only to bound in-flight jobs)."""
        while len(self._jobs) >= self._max_inflight:
            self._settle_early(next(iter(self._jobs)))
        if self.retained.crowded(plan.dst_tier):  # one job at a time into it (``RetainedCopies``)
            for job_id in [j for j, job in self._jobs.items() if job.plan.dst_tier == plan.dst_tier]:
                self._settle_early(job_id)
        kept = self.retained.claim(plan.job_id, plan.dst_tier, plan.ids)
        self.retained.bound(plan.dst_tier, plan.job_id)
        try:
            self._jobs[plan.job_id] = self._start_in_room(plan, kept)
        except BaseException:
            self.retained.settle(plan.job_id, False)
            raise

    def _start_in_room(self, plan: TransferPlan, kept: set[int]) -> Job:
        """``_start``, once the store has a physical slot for each block to write beside the
        copies the job displaced (``RetainedCopies.bound``): its spare slots beyond the tier's
        capacity, freed by a flush if retired. Where the job displaced more copies than that,
        the oldest it needs are deleted (and flushed) first: those alone a failed write can
        still cost. Every flush here precedes the job's writes."""
        if self.retained.displaced(plan.job_id):
            medium, need = self.tiers[plan.dst_tier], len(plan.ids) - len(kept)
            if getattr(medium, "free_blocks", need) < need:
                _flush_quietly(medium)
            if (short := need - getattr(medium, "free_blocks", need)) > 0:
                self.retained.give_up(plan.job_id, short)
                _flush_quietly(medium)
        return self._start(plan, kept)

    def _start(self, plan: TransferPlan, kept: set[int]) -> Job:
        """Starts the copy of the part of ``plan`` whose copies are not retained in its
        destination (``kept`` are taken up as they are: no write)."""
        src, dst = self.tiers[plan.src_tier], self.tiers[plan.dst_tier]
        part = plan
        if kept:
            rest = [n for n, block_id in enumerate(plan.ids) if block_id not in kept]
            if not rest:
                return Job(plan, result=JobResult(plan.job_id))
            part = replace(plan, ids=tuple(plan.ids[n] for n in rest), src_slots=plan.src_slots[rest],
                           dst_slots=plan.dst_slots[rest])
        return self._handler(plan.src_tier, plan.dst_tier).start(part, src, dst, self._ctx)

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

    def end_call(self) -> None:
        """A store call ended (``RetainedCopies.end_call``), the jobs still running named: a
        departure from a tier that one of them writes back into is kept for its settle."""
        arriving: dict[int, set[int]] = {}
        for job in self._jobs.values():
            arriving.setdefault(job.plan.dst_tier, set()).update(job.plan.ids)
        self.retained.end_call(arriving)

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
            self.retained.settle(job_id, False)
            raise
        del self._jobs[job_id]
        link = (job.plan.src_tier, job.plan.dst_tier)
        if taken := self.retained.settle(job_id, result.ok):
            self.taken_up[link] = self.taken_up.get(link, 0) + taken
        if result.ok and result.present:
            self.already_there[link] = self.already_there.get(link, 0) + result.present
        if result.ok:
            self.retained.returned(job.plan.dst_tier, job.plan.ids)
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


def _flush_quietly(medium) -> None:
    """Flushes ``medium``; a failure is counted by the store and its batch kept for the next flush."""
    try:
        medium.flush()
    except OSError:
        pass


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
