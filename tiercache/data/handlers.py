"""Copy handlers: one per (source medium, destination medium) pair, registered in one place.

A handler starts the byte movement of one ``TransferPlan`` between two media and returns a
``Job`` the engine tracks until it settles: an immediate result, a CUDA event, or an I/O
future plus the function that turns its outcome into a ``JobResult``. Handlers decide
nothing and never touch metadata.

Adding a medium (the remote store, a quantised pool) is one medium class plus one handler per
pair it takes part in, registered in ``HANDLERS`` (or with ``register_handler`` from outside
the package); the engine finds the handler of each tier pair once, when it is built.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from tiercache.core.plans import JobResult, TransferPlan

from .buffers import torch_dtype
from .nvme import NVMeStore, PutResult, StoreFullError
from .pools import BlockPool
from .remote import ALREADY_THERE, NO_ANSWER, RemoteStore

__all__ = ["Job", "CopyContext", "CopyHandler", "HANDLERS", "register_handler", "handler_for"]


@dataclass
class Job:
    """One submitted plan, settled exactly once by the engine.

    Exactly one of ``result`` (finished at submission), ``event`` (a CUDA copy; done when
    the event is) or ``future`` (NVMe I/O; ``finish`` maps its outcome to a result) is set.
    """

    plan: TransferPlan
    result: JobResult | None = None
    event: object | None = None
    future: Future | None = None
    finish: Callable[[object], JobResult] | None = None


@dataclass
class CopyContext:
    """What handlers share, owned by the engine.

    Attributes:
        key_of: the content key of a block id (for keyed media such as NVMe).
        h2d_stream: CUDA copy stream towards the GPU (None without CUDA).
        d2h_stream: CUDA copy stream from the GPU (None without CUDA).
        staging: pinned host blocks that GPU <-> NVMe copies pass through (None without CUDA).
        settle_all: finishes every job in flight (before staging is reused).
    """

    key_of: Callable[[int], bytes]
    h2d_stream: object | None
    d2h_stream: object | None
    staging: BlockPool | None
    settle_all: Callable[[], None]

    def keys(self, ids: Sequence[int]) -> list[bytes]:
        """Content keys of ``ids``, in order."""
        return [self.key_of(block_id) for block_id in ids]

    def pieces(self, n: int) -> list[tuple[int, int]]:
        """Staging-sized ``(start, count)`` pieces of an n-block job; settles every job in
        flight first, so none still reads the staging pool when it is reused."""
        self.settle_all()
        step = self.staging.capacity
        return [(a, min(step, n - a)) for a in range(0, n, step)]


class CopyHandler(Protocol):
    """Starts one plan's copy between two given media."""

    def start(self, plan: TransferPlan, src, dst, ctx: CopyContext) -> Job:
        """Starts copying ``plan.ids`` from ``src`` slots to ``dst`` slots; never blocks
        longer than the medium requires (CPU pool copies finish inline)."""


class PoolToPool:
    """HBM <-> DRAM: a CUDA copy stream with one event per job, or an inline host copy."""

    def start(self, plan: TransferPlan, src: BlockPool, dst: BlockPool, ctx: CopyContext) -> Job:
        if ctx.h2d_stream is None:
            src.copy_to(dst, plan.src_slots, plan.dst_slots, non_blocking=False)
            return Job(plan, result=JobResult(plan.job_id))
        stream = ctx.h2d_stream if dst.device.type == "cuda" else ctx.d2h_stream
        # The copy stream must see every write the compute stream queued into the source
        # slots (a fill or a kernel); without this wait it could copy stale bytes.
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            src.copy_to(dst, plan.src_slots, plan.dst_slots, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return Job(plan, event=event)


class PoolToStore:
    """HBM or DRAM -> NVMe: I/O threads write the pool's slot views (host pools), or the
    blocks pass through the pinned staging pool piece by piece (GPU pools).

    The NVMe store chooses the physical slots itself (the plan's destination slots are the
    manager's count of room, not places on disk): a slot freed by a deletion is reused only
    once that deletion is durable, so a block flushed to NVMe keeps its bytes until a flush
    records that it left, and a crash never finds a durable entry over someone else's bytes.
    """

    def start(self, plan: TransferPlan, src: BlockPool, store: NVMeStore, ctx: CopyContext) -> Job:
        keys = ctx.keys(plan.ids)
        if src.device.type != "cpu":
            return Job(plan, result=_staged_put(plan, keys, src, store, ctx))
        views = [src.view(int(slot)) for slot in plan.src_slots]
        future = _recycling(store.submit_put, store, keys, views)
        return Job(plan, future=future, finish=lambda outcome: _write_result(plan, store, outcome))


class StoreToPool:
    """NVMe -> HBM or DRAM: I/O threads read into the pool's slot views (host pools), or
    through the pinned staging pool (GPU pools). Unreadable blocks are reported lost."""

    def start(self, plan: TransferPlan, store: NVMeStore, dst: BlockPool, ctx: CopyContext) -> Job:
        keys = ctx.keys(plan.ids)
        if dst.device.type != "cpu":
            return Job(plan, result=_staged_get(plan, keys, store, dst, ctx))
        views = [dst.view(int(slot)) for slot in plan.dst_slots]
        return Job(plan, future=store.submit_get(keys, views), finish=lambda hits: _read_result(plan, hits))


def _recycling(put, store: NVMeStore, keys: list[bytes], views: list[torch.Tensor]):
    """``put(keys, views)``; when only slots of not-yet-durable deletions are left, flushes
    once (making those deletions durable frees their slots) and tries again."""
    try:
        return put(keys, views)
    except StoreFullError:
        store.flush()
        return put(keys, views)


def _write_result(plan: TransferPlan, store: NVMeStore, outcome: list[PutResult]) -> JobResult:
    """A write job's result. The plan fails as a whole: the blocks that did land are taken
    back, so no store entry outlives the manager's decision that these slots stay free."""
    failed = [r for r in outcome if not r.ok]
    if not failed:
        return JobResult(plan.job_id)
    store.delete([r.key for r in outcome if r.ok])
    return JobResult(plan.job_id, f"write failed: {failed[0].error}")


def _read_result(plan: TransferPlan, hits: np.ndarray) -> JobResult:
    """A read job's result from its hit mask; unreadable sources are ``lost``."""
    lost = tuple(b for b, ok in zip(plan.ids, hits.tolist()) if not ok)
    if lost:
        return JobResult(plan.job_id, f"{len(lost)} block(s) unreadable (corrupt or missing)", lost)
    return JobResult(plan.job_id)


def _staged_put(plan: TransferPlan, keys: list[bytes], src: BlockPool, store: NVMeStore, ctx: CopyContext) -> JobResult:
    """GPU -> NVMe through the pinned staging pool, one staging-sized piece at a time."""
    staging = ctx.staging
    for a, n in ctx.pieces(len(keys)):
        src.copy_to(staging, plan.src_slots[a : a + n], np.arange(n), non_blocking=False)
        results = _recycling(store.put, store, keys[a : a + n], [staging.view(i) for i in range(n)])
        failed = [r for r in results if not r.ok]
        if failed:  # the plan fails whole: take back what landed
            store.delete(keys[:a] + [r.key for r in results if r.ok])
            return JobResult(plan.job_id, f"write failed: {failed[0].error}")
    return JobResult(plan.job_id)


def _staged_get(plan: TransferPlan, keys: list[bytes], store: NVMeStore, dst: BlockPool, ctx: CopyContext) -> JobResult:
    """NVMe -> GPU through the pinned staging pool; unreadable blocks are reported lost."""
    staging, lost = ctx.staging, []
    for a, n in ctx.pieces(len(keys)):
        hits = store.get(keys[a : a + n], [staging.view(i) for i in range(n)])
        lost.extend(b for b, ok in zip(plan.ids[a : a + n], hits.tolist()) if not ok)
        if not lost:
            staging.copy_to(dst, np.arange(n), plan.dst_slots[a : a + n], non_blocking=False)
    if lost:
        return JobResult(plan.job_id, f"{len(lost)} block(s) unreadable (corrupt or missing)", tuple(lost))
    return JobResult(plan.job_id)


def _bytes(block: torch.Tensor) -> np.ndarray:
    """A contiguous host block as a uint8 numpy view of the same memory (no copy)."""
    return block.view(torch.uint8).reshape(-1).numpy()


def _take_rows(remote: RemoteStore, n: int, ctx: CopyContext) -> list[int] | None:
    """``n`` staging rows of the remote medium, settling jobs in flight if none are free;
    None when the plan is larger than the staging area (the caller goes piece by piece)."""
    rows = remote.take_rows(n)
    if rows is None and n <= remote.config.staging_blocks:
        ctx.settle_all()  # every finished job has given its rows back
        rows = remote.take_rows(n)
    return rows


def _remote_put_result(plan: TransferPlan, ok: list[bool], lost: tuple[int, ...] = ()) -> JobResult:
    """A remote write fails as a whole (the copies that landed stay, harmless: same key,
    same bytes); it never reports its sources lost unless their own copy was unreadable."""
    present = sum(1 for answer in ok if answer == ALREADY_THERE)
    if all(ok) and not lost:
        return JobResult(plan.job_id, present=present)
    return JobResult(plan.job_id, f"remote put failed for {ok.count(False)} of {len(ok)} block(s)", lost, present)


def _remote_get_result(plan: TransferPlan, ok: list[bool | None]) -> JobResult:
    """A remote read's result: blocks missing or corrupt are ``lost`` (a miss: they leave the
    view). Blocks the store did not answer for (``NO_ANSWER``) fail the job too, but are not
    lost: the store may well hold them, so they stay in the view for a later read."""
    lost = tuple(b for b, good in zip(plan.ids, ok) if good is not NO_ANSWER and not good)
    unanswered = sum(1 for good in ok if good is NO_ANSWER)
    why = ([f"{len(lost)} remote block(s) missing or unreadable"] if lost else []) + \
        ([f"the remote store did not answer for {unanswered} block(s)"] if unanswered else [])
    return JobResult(plan.job_id, "; ".join(why), lost) if why else JobResult(plan.job_id)


class PoolToRemote:
    """HBM or DRAM -> remote: host pools are put in place (registered slot memory, zero
    copy; with header room, each value's header is written right before its block and both
    go as one buffer); GPU pools pass through the medium's registered staging rows."""

    def start(self, plan: TransferPlan, src: BlockPool, remote: RemoteStore, ctx: CopyContext) -> Job:
        keys = ctx.keys(plan.ids)
        if src.device.type == "cpu":
            remote.register(src.host_buffer)
            future = remote.submit_put(keys, [_bytes(src.view(int(s))) for s in plan.src_slots], headers=_headers(src, plan.src_slots))
            return Job(plan, future=future, finish=lambda ok: _remote_put_result(plan, ok))
        rows = _take_rows(remote, len(keys), ctx)
        if rows is None:  # larger than the staging area: piece by piece, waiting
            ok = []
            for a, n in _pieces(len(keys), remote.config.staging_blocks):
                ok += self.start(_sub(plan, a, n), src, remote, ctx).future.result()
            return Job(plan, result=_remote_put_result(plan, ok))
        for row, slot in zip(rows, plan.src_slots):
            remote.row_block(row, src.dtype).copy_(src.view(int(slot)))
        future = remote.submit_put(keys, [remote.staging[r] for r in rows], then=lambda: remote.give_rows(rows))
        return Job(plan, future=future, finish=lambda ok: _remote_put_result(plan, ok))


class RemoteToPool:
    """Remote -> HBM or DRAM: host pools are read in place (the checksum is verified on
    the slot before the manager publishes it); GPU pools through the staging rows."""

    def start(self, plan: TransferPlan, remote: RemoteStore, dst: BlockPool, ctx: CopyContext) -> Job:
        keys = ctx.keys(plan.ids)
        if dst.device.type == "cpu":
            remote.register(dst.host_buffer)
            future = remote.submit_get(keys, [_bytes(dst.view(int(s))) for s in plan.dst_slots], headers=_headers(dst, plan.dst_slots))
            return Job(plan, future=future, finish=lambda ok: _remote_get_result(plan, ok))
        rows = _take_rows(remote, len(keys), ctx)
        if rows is None:
            ok = []
            for a, n in _pieces(len(keys), remote.config.staging_blocks):
                ok += _remote_get_ok(self.start(_sub(plan, a, n), remote, dst, ctx))
            return Job(plan, result=_remote_get_result(plan, ok))

        def finish(ok: list[bool]) -> JobResult:
            for row, slot, good in zip(rows, plan.dst_slots, ok):
                if good:
                    dst.view(int(slot)).copy_(remote.row_block(row, dst.dtype))
            remote.give_rows(rows)
            return _remote_get_result(plan, ok)

        return Job(plan, future=remote.submit_get(keys, [remote.staging[r] for r in rows]), finish=finish)


def _headers(pool: BlockPool, slots) -> list[np.ndarray] | None:
    """The header place right before each slot's block, where the pool keeps header room."""
    return [pool.header(int(s)) for s in slots] if pool.header_room else None


class StoreToRemote:
    """NVMe -> remote: the NVMe I/O threads read into registered staging rows, then one
    batched put sends them; a chunk unreadable on NVMe is reported lost (as any read)."""

    def start(self, plan: TransferPlan, store: NVMeStore, remote: RemoteStore, ctx: CopyContext) -> Job:
        keys = ctx.keys(plan.ids)
        rows = _take_rows(remote, len(keys), ctx)
        if rows is None:
            results = []
            for a, n in _pieces(len(keys), remote.config.staging_blocks):  # each piece ends before the next
                job = self.start(_sub(plan, a, n), store, remote, ctx)
                results.append(job.finish(job.future.result()))
            return Job(plan, result=_merge(plan, results))
        hits = store.get(keys, [remote.row_block(r, _dtype(remote)) for r in rows])
        readable = [n for n, hit in enumerate(hits.tolist()) if hit]
        lost = tuple(plan.ids[n] for n in range(len(keys)) if not hits[n])
        future = remote.submit_put([keys[n] for n in readable], [remote.staging[rows[n]] for n in readable],
                                   then=lambda: remote.give_rows(rows))
        return Job(plan, future=future, finish=lambda ok: _remote_put_result(plan, ok, lost))


def _dtype(remote: RemoteStore) -> torch.dtype:
    return torch_dtype(remote.layout.dtype)


def _pieces(n: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(step, n - a)) for a in range(0, n, step)]


def _sub(plan: TransferPlan, a: int, n: int) -> TransferPlan:
    """The part ``[a, a + n)`` of a plan (same job id), for piece-by-piece transfers."""
    return TransferPlan(plan.job_id, plan.ids[a : a + n], plan.src_tier, plan.src_slots[a : a + n], plan.dst_tier,
                        plan.dst_slots[a : a + n], plan.keep_source)


def _remote_get_ok(job: Job) -> list[bool | None]:
    """Settles a piece's job now (its finish copies staged blocks in); its answer per block
    (True, False or ``NO_ANSWER``, as ``RemoteStore.submit_get``)."""
    ok = job.future.result()
    job.finish(ok)
    return list(ok)


def _merge(plan: TransferPlan, results: list[JobResult]) -> JobResult:
    errors = [r.error for r in results if not r.ok]
    lost = tuple(b for r in results for b in r.lost)
    return JobResult(plan.job_id, errors[0] if errors else None, lost, sum(r.present for r in results))


#: The one registry: (source medium class, destination medium class) -> handler.
HANDLERS: dict[tuple[type, type], CopyHandler] = {
    (BlockPool, BlockPool): PoolToPool(),
    (BlockPool, NVMeStore): PoolToStore(),
    (NVMeStore, BlockPool): StoreToPool(),
    (BlockPool, RemoteStore): PoolToRemote(),
    (RemoteStore, BlockPool): RemoteToPool(),
    (NVMeStore, RemoteStore): StoreToRemote(),
}


def register_handler(src_type: type, dst_type: type, handler: CopyHandler) -> None:
    """Registers the handler of a new (source, destination) medium pair.

    Raises:
        ValueError: the pair already has a handler.
    """
    if (src_type, dst_type) in HANDLERS:
        raise ValueError(f"copy handler for {src_type.__name__} -> {dst_type.__name__} is already registered")
    HANDLERS[(src_type, dst_type)] = handler


def handler_for(src: object, dst: object) -> CopyHandler:
    """The handler registered for the media's classes (or their nearest base classes).

    Raises:
        TypeError: no handler moves bytes between these media; the message lists the pairs.
    """
    for src_type in type(src).__mro__:
        for dst_type in type(dst).__mro__:
            handler = HANDLERS.get((src_type, dst_type))
            if handler is not None:
                return handler
    known = ", ".join(f"{a.__name__}->{b.__name__}" for a, b in HANDLERS)
    raise TypeError(f"no copy handler for {type(src).__name__} -> {type(dst).__name__}; registered: {known}")
