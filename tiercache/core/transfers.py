"""The manager's two-phase transfer API: blocking and non-blocking moves between tiers.

Every byte movement the manager decides (promotions, prefetches, demotions, write-through
copies, write-backs) goes through one lifecycle, and nothing outside the manager runs it:

1. ``prepare_move`` pins the sources and reserves destination slots (or returns None and
   changes nothing);
2. ``start_move`` submits the plan to the injected engine and returns at once with the plan
   (its ``job_id`` is the handle: ``wait(job_id)``; a live engine maps it to a CUDA event);
3. ``poll`` applies every job the engine has finished, ``wait`` applies one, blocking;
4. ``complete`` unpins the sources and publishes the destination (or releases it on
   failure). A block is visible in its new tier only after its bytes landed.

The blocking calls are this path plus a wait. ``SimEngine`` drives the same path in a
replay, so a prefetch measured in simulated time is the prefetch that runs live.
"""

from __future__ import annotations

from functools import partial
from typing import Mapping, Sequence

import numpy as np

from tiercache.policies.base import NO_NEXT_USE, Hints

from .interrupts import interruptible_wait
from .plans import Ev, JobResult, Room, TransferPlan

__all__ = ["TransferMixin"]


class TransferMixin:
    """Two-phase moves of ``TierManager`` (split out to keep modules small).

    Relies on the manager's ``dirs``, ``policies``, ``_hooks`` (each tier's eviction hooks:
    ``tiercache.core.answers.hooks``), ``engine``, ``events``, ``refs``,
    ``orphan_refs``, ``write_through``, ``shared``, ``inflight``, ``_running``, ``_may_block``,
    ``_plan_hints``, ``_next_job``, ``_future`` and ``_chunk_caps``, on ``_make_room``,
    ``_room_possible`` and ``_place_in_pieces`` (``RoomMixin``) and on ``_orphan_holds``
    (``HoldMixin``). Invariants: every plan in ``inflight`` has its sources pinned and its
    destination slots reserved; a source a move (not a copy) takes out of its tier is pinned
    by that plan alone (copies may share theirs); a plan leaves ``inflight`` exactly once, in
    ``complete``, which applies it whole or takes it back whole;
    ``_running`` (the jobs ``start_move`` submitted, the only ones the manager waits for
    itself) is a subset of ``inflight``.
    """

    # -- phase one: plan -----------------------------------------------------------------
    def prepare_move(self, ids: Sequence[int], src: int, dst: int, keep_source: bool = False) -> TransferPlan | None:
        """Pins sources in ``src`` and reserves free slots in ``dst``; None changes nothing.

        None when an id is absent from ``src``, already in ``dst`` or on its way there, pinned
        by another move, repeated, or when ``dst`` has fewer free slots than ids (call
        ``make_room`` first). A copy (``keep_source``) may share a source with other copies,
        never with a move in flight that takes the block out of ``src`` (``_leaving``): that
        move's ``complete`` removes the block, which it could not while a copy still reads it.
        """
        src_dir, dst_dir = self.dirs[src], self.dirs[dst]
        if keep_source and not self.write_through and dst != self.shared:
            return None  # an exclusive hierarchy never holds two copies of a block (but publishes)
        if src == dst or not ids or len(set(ids)) != len(ids) or dst_dir.n_free < len(ids):
            return None
        for block_id in ids:
            if block_id not in src_dir.slot_of or block_id in dst_dir.slot_of:
                return None
            if not keep_source and block_id in src_dir.pins:
                return None
        if self.inflight and (self._arriving(ids, dst) or keep_source and self._leaving(ids, src)):
            return None  # a copy of one of them is already on its way there, or one is moving out of src
        src_dir.pin(ids)
        reserved: list[int] = []
        try:  # pinned and reserved exactly when the plan is in flight, whatever raises in between
            reserved = dst_dir.reserve(len(ids))
            plan = TransferPlan(self._next_job, tuple(ids), src, src_dir.slots(ids), dst,
                                np.asarray(reserved, dtype=np.int64), keep_source)
            self._next_job += 1
            self.inflight[plan.job_id] = plan
        except BaseException:
            if reserved:
                dst_dir.release(reserved)
            src_dir.unpin(ids)
            raise
        return plan

    def _arriving(self, ids: Sequence[int], dst: int) -> bool:
        """True when an in-flight plan is already bringing one of ``ids`` into ``dst``."""
        wanted = set(ids)
        return any(plan.dst_tier == dst and not wanted.isdisjoint(plan.ids) for plan in self.inflight.values())

    def _leaving(self, ids: Sequence[int], src: int) -> bool:
        """True when an in-flight move (not a copy) is taking one of ``ids`` out of ``src``."""
        pins = self.dirs[src].pins
        if not any(block_id in pins for block_id in ids):
            return False  # only a pinned block is read by a transfer in flight
        wanted = set(ids)
        return any(plan.src_tier == src and not plan.keep_source and not wanted.isdisjoint(plan.ids)
                   for plan in self.inflight.values())

    # -- phase two: run ------------------------------------------------------------------
    def start_move(self, ids: Sequence[int], src: int, dst: int, keep_source: bool = False,
                   hints: Hints | None = None) -> TransferPlan | None:
        """Plans and submits a move without waiting; returns the plan in flight, or None.

        None when no plan could be made (see ``prepare_move``) or the engine refused the
        submission (then the plan is completed as failed at once: nothing stays pinned).
        The destination is published by ``poll`` or ``wait`` once the bytes landed.
        """
        plan = self.prepare_move(ids, src, dst, keep_source)
        if plan is None:
            return None
        try:
            self._plan_hints[plan.job_id] = hints if hints is not None else self._future_hints(ids)
            self.engine.submit(plan)
            self._running.add(plan.job_id)
        except BaseException as exc:  # a failed submit, an interrupt too, must not leave the plan pinned
            self._running.discard(plan.job_id)
            self.complete(JobResult(plan.job_id, f"engine failed: {type(exc).__name__}: {exc}"))
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: the plan is undone, the interrupt goes on
            return None
        return plan

    def prefetch(self, ids: Sequence[int], dst: int = 0,
                 parents: Mapping[int, int | None] | None = None) -> list[TransferPlan]:
        """Starts bringing resident ids from lower tiers up to ``dst``; returns the plans.
        ``parents`` (optional) gives each id its prefix-tree parent, handed to ``dst``'s policy
        with the block when it lands (``request_hints``: a request's ids, as a read gives them).

        Room in ``dst`` is made at once (victims demoted as usual, never one of a run's own
        ids; the ids asked for are kept while it runs, as ``access``'s ``keep_all``: they may
        move down, never out of the hierarchy, so no run's room pushes another asked block out);
        ids already in ``dst`` or above, absent, or already moving are skipped. In an
        exclusive hierarchy the blocks move; in write-through they are copied up. Until a
        plan completes, lookups still find its blocks where they were.

        The ids found in one tier move as one plan, or, when room cannot be made for all of
        them at once (more than ``dst`` or a tier on its victims' way down holds, or slots
        pinned), in pieces of what fits, first ids first (``_place_in_pieces``); the ids no
        room is found for stay where they are, counted as ``PROMOTE_SKIPPED`` in their tier.
        """
        wanted = list(dict.fromkeys(ids))
        kept = self._kept
        self._kept = kept.union(wanted)  # asked ids may move down, never out (as ``access``'s keep_all)
        try:
            return self._prefetch_runs(wanted, dst, parents)
        finally:
            self._kept = kept

    def _prefetch_runs(self, wanted: list[int], dst: int, parents: Mapping[int, int | None] | None) -> list[TransferPlan]:
        """``prefetch``'s runs, one per lower tier, while ``wanted`` are kept."""
        plans: list[TransferPlan] = []
        for tier in range(dst + 1, len(self.dirs)):
            pins, here = self.dirs[tier].pins, self.dirs[tier].slot_of
            below = [b for b in wanted if b in here and b not in pins and self.locate(b) == tier]
            if not below:
                continue
            guard = frozenset(below)  # the whole run, through every piece: no piece pushes down another
            place = partial(self._prefetch_piece, below, tier, dst, guard, plans, parents)
            fit = partial(self._prefetch_fit, dst, guard)
            for a, b in self._place_in_pieces([(0, len(below))], place, fit):
                self.events.emit(Ev.PROMOTE_SKIPPED, tier, b - a)
        return plans

    def _prefetch_piece(self, below: Sequence[int], tier: int, dst: int, guard: frozenset, plans: list,
                        parents: Mapping[int, int | None] | None, a: int, b: int) -> bool:
        """Starts moving ``below[a:b]`` from ``tier`` up to ``dst`` (its plan appended to
        ``plans``); False when no room could be made now. Never waits: a prefetch that finds
        no room (slots held by moves in flight, or everything pinned) goes without."""
        if not self._room_without_waiting(dst, b - a, guard):
            return False
        plan = self.start_move(below[a:b], tier, dst, keep_source=self.write_through,
                               hints=self._move_hints(below[a:b], parents))
        if plan is not None:
            plans.append(plan)
        return True

    def _prefetch_fit(self, dst: int, guard: frozenset) -> int:
        """Most blocks one prefetch piece into ``dst`` can take now: no more than room can be
        made for there (``_room_possible``) nor than the smallest tier from ``dst`` down holds
        (so its victims never outnumber a tier's slots on their way down); inside
        ``passing_full_tiers``, no more than the hierarchy's free slots either, where it has any
        (as ``_promote`` cuts a run: a longer piece would be declined for pushing a block out
        of the last tier while a slot is free)."""
        fit = min(self._room_possible(dst, guard), self._chunk_caps[dst])
        free = self._free_slots() if self._pass_full else 0
        return min(fit, free) if free else fit

    def _room_without_waiting(self, tier: int, n: int, protected) -> bool:
        """``_make_room`` whose cascade never waits for a move in flight (it goes without)."""
        self._may_block = False
        try:
            return self._make_room(tier, n, protected) is Room.MADE
        finally:
            self._may_block = True

    def publish(self, ids: Sequence[int], prefix: bool = False) -> list[TransferPlan]:
        """Starts copying resident ids into the shared last tier, keeping them where they are.

        One plan per source tier; ids the shared tier holds or is receiving, ids a move in
        flight is taking out of their tier (a prefetch: the copy would read a block about to
        leave; publish it once the move completed), absent ids and a manager without a shared
        tier are skipped, before any room is made. Room is made in the shared tier at once
        (its victims only leave this manager's view; never one of ``ids``). Returns the plans
        in flight.

        Head first: when room can be made for fewer of the remaining ids than there are (more
        than the shared tier holds, or its slots pinned or referenced), the first ones that
        fit are published, in the order given, and the rest skipped (``_publish_head``).

        With ``prefix`` True, ``ids`` are a request's blocks from its start (a prompt's
        chain): only the part that extends what the shared tier holds is written
        (``_publish_chain``: from the request's start, blocks the shared tier holds or
        receives pass, the others are written up to the first one that cannot be, absent or
        leaving its tier, past which nothing is reachable), and the request's blocks the shared
        tier holds are never evicted for it (invariant: after the call every block written
        has its whole parent prefix in the shared tier or on its way there).
        """
        shared = self.shared
        if shared is None:
            return []
        ids = list(dict.fromkeys(ids))
        guard = frozenset(ids)
        if prefix:
            local = self._publish_chain(ids)
        else:
            local = [b for b in ids if b not in self.dirs[shared].slot_of and self.locate(b) is not None]
        wanted = self._publish_head(local, guard)
        plans = []
        for tier in range(shared):
            here = [b for b in wanted if self.locate(b) == tier]
            if here and self._make_room(shared, len(here), guard) is Room.MADE:
                plan = self.start_move(here, tier, shared, keep_source=True)
                if plan is not None:
                    plans.append(plan)
        return plans

    def _publish_chain(self, ids: list[int]) -> list[int]:
        """The blocks of the chain ``ids`` (a request's, from its start) to write: those the
        shared tier neither holds nor receives, in order, up to the first block that is
        neither there nor can be written (held by no tier, or a move in flight takes it out
        of its tier): a block past that one has a parent the shared tier lacks, so no lookup
        would reach it."""
        there = self.dirs[self.shared].slot_of
        incoming, leaving = set(), set()
        for p in self.inflight.values():
            if p.dst_tier == self.shared:
                incoming.update(p.ids)
            elif not p.keep_source:
                leaving.update(p.ids)
        chain = []
        for block_id in ids:
            if block_id in there or block_id in incoming:
                continue
            if self.locate(block_id) is None or block_id in leaving:
                break
            chain.append(block_id)
        return chain

    def _publish_head(self, wanted: list[int], guard: frozenset) -> list[int]:
        """The leading ids of ``wanted`` that ``publish`` copies: those not busy (a move in
        flight brings them into the shared tier or takes them out of theirs), cut to as many
        as room can be made for in the shared tier now (``_room_possible``, never evicting
        ``guard``).

        Head first, not every id in pieces: a prefix-keyed store is read only as a leading
        run (a lookup stops at the first block it lacks), so of a request longer than the
        shared tier only a head can ever be hit; pieces written one after another would each
        push out the one before, leaving a tail no lookup reaches, its traffic and the other
        blocks it evicted spent for nothing. It is also what the view keeps of a prefix longer
        than itself (``RemoteLink._adopt_head``). Callers hand ids in prefix order (a request's
        new blocks) or oldest first (the retry queue)."""
        if self.inflight:
            busy = {b for p in self.inflight.values() if p.dst_tier == self.shared or not p.keep_source for b in p.ids}
            wanted = [b for b in wanted if b not in busy]
        if len(wanted) > self.dirs[self.shared].n_free:
            wanted = wanted[: self._room_possible(self.shared, guard)]
        return wanted

    def _leave_for_shared(self, tier: int, victims: list[int]) -> list[int]:
        """Victims the shared tier below already holds leave ``tier`` without a copy (counted
        as demoted, touched below, and per link in ``left_for_shared``: nothing crosses);
        returns the others, which still need their copy."""
        shared = self.dirs[self.shared].slot_of
        held = [v for v in victims if v in shared]
        if held:
            self._hooks[tier].on_remove(held)
            self.engine.discard(tier, held, self.dirs[tier].remove(held))
            self._hooks[self.shared].on_access(held, None)
            self.events.emit(Ev.DEMOTE, tier, len(held), self.shared)
            link = (tier, self.shared)
            self.left_for_shared[link] = self.left_for_shared.get(link, 0) + len(held)
        return [v for v in victims if v not in shared] if held else victims

    # -- phase three: finish -------------------------------------------------------------
    def poll(self) -> list[TransferPlan]:
        """Applies every job the engine has finished (never blocks); returns their plans."""
        return [self.complete(result) for result in self.engine.poll() if result.job_id in self.inflight]

    def wait(self, job_id: int) -> JobResult | None:
        """Blocks until ``job_id`` has finished and applies it; returns its result.

        Returns None when the job was already applied (by ``poll`` or an earlier ``wait``):
        a caller holding a handle never has to know who completed it.

        Raises:
            KeyError: the job was prepared (``prepare_move``) but not started by
                ``start_move``: whoever prepared it submits and completes it.
        """
        if job_id not in self.inflight:
            return None
        if job_id not in self._running:
            raise KeyError(f"job {job_id} was prepared but not started by the manager (use start_move)")
        try:
            with interruptible_wait():  # a Ctrl-C while blocked leaves the job in flight (``engine.wait``)
                result = self.engine.wait(job_id)
        except Exception as exc:  # noqa: BLE001 - an engine error fails the job, not the manager
            result = JobResult(job_id, f"engine failed: {type(exc).__name__}: {exc}")
        return self._apply(result)[1]

    def wait_all(self) -> list[JobResult]:
        """Waits for and applies every job this manager started, oldest first."""
        results = [self.wait(job_id) for job_id in sorted(self._running)]
        return [r for r in results if r is not None]

    def complete(self, result: JobResult) -> TransferPlan:
        """Applies a finished job: publishes the destination, or undoes the reservation.

        Never half-way: a job that landed but cannot be applied whole (``_refusal``) is
        taken back as failed before anything else changes; its blocks stay where they were.
        """
        return self._apply(result)[0]

    def _apply(self, result: JobResult) -> tuple[TransferPlan, JobResult]:
        """``complete``; returns the plan and the result applied (failed if taken back)."""
        plan = self.inflight.pop(result.job_id)
        self._running.discard(plan.job_id)
        hints = self._plan_hints.pop(plan.job_id, None)
        src_dir, dst_dir = self.dirs[plan.src_tier], self.dirs[plan.dst_tier]
        src_dir.unpin(plan.ids)
        if result.ok and (refusal := self._refusal(plan)) is not None:
            result = JobResult(plan.job_id, refusal)
        if not result.ok:
            dst_dir.release(plan.dst_slots)
            self.events.emit(Ev.TRANSFER_FAILED, plan.src_tier, plan.n_blocks, plan.dst_tier)
            lost = [b for b in result.lost if b in src_dir.slot_of and b not in src_dir.pins]
            self._drop_lost(plan.src_tier, self._fall_back(plan.src_tier, lost))
            return plan, result
        if not plan.keep_source:
            self._hooks[plan.src_tier].on_remove(plan.ids)
            freed = src_dir.remove(plan.ids)
        dst_dir.publish(plan.ids, plan.dst_slots)
        self._hooks[plan.dst_tier].on_insert(plan.ids, hints)
        if not plan.keep_source:  # after publishing: the engine may ask where blocks now live
            self.engine.discard(plan.src_tier, plan.ids, freed)
        self.events.emit(_move_kind(plan), plan.src_tier, plan.n_blocks, plan.dst_tier)
        return plan, result

    def _refusal(self, plan: TransferPlan) -> str | None:
        """Why a landed ``plan`` (its sources unpinned) cannot be applied whole, or None.

        Its destination tier holds one of its blocks already, or (a move, not a copy) another
        transfer still reads one of its sources, which a move must remove. ``prepare_move``
        admits neither; this keeps ``complete`` whole should one ever slip in. A move taken
        back for a source still read gives up the copies it wrote (``engine.discard``).
        """
        if any(block_id in self.dirs[plan.dst_tier].slot_of for block_id in plan.ids):
            return f"a block of the move is already in tier {self.dirs[plan.dst_tier].name}: taken back"
        pins = self.dirs[plan.src_tier].pins
        if plan.keep_source or not any(block_id in pins for block_id in plan.ids):
            return None
        self.engine.discard(plan.dst_tier, plan.ids, plan.dst_slots)
        return f"a source in tier {self.dirs[plan.src_tier].name} is still read by another transfer: taken back"

    # -- the blocking path ---------------------------------------------------------------
    def move(self, ids: Sequence[int], src: int, dst: int) -> bool:
        """Moves (exclusive) or copies (write-through) ``ids`` from ``src`` to free slots of
        ``dst`` and waits for it; False when the plan could not be made or failed."""
        return self._transfer(ids, src, dst, self.write_through, None)

    def _transfer(self, ids: Sequence[int], src: int, dst: int, keep_source: bool, hints: Hints | None,
                  started: list | None = None) -> bool:
        """Starts one plan and, unless ``started`` collects it, waits for it; True on success
        (for a plan left running: on a successful start)."""
        plan = self.start_move(ids, src, dst, keep_source, hints)
        if plan is None:
            return False
        if started is not None:
            started.append(plan)
            return True
        return self.wait(plan.job_id).ok

    def report_lost(self, tier: int, ids: Sequence[int]) -> None:
        """A reader found the stored bytes of ``ids`` in ``tier`` unreadable (checksum or
        I/O): they leave the hierarchy, counted as lost, exactly as on a failed promotion."""
        here = self.dirs[tier].slot_of
        self._drop_lost(tier, [block_id for block_id in ids if block_id in here and block_id not in self.dirs[tier].pins])

    def _fall_back(self, tier: int, lost: list[int]) -> list[int]:
        """Moves the ``lost`` blocks of ``tier`` that still have a retained copy in a tier
        below (the engine's ``retained``: a keyed tier they were read up out of) back onto
        that copy; returns the rest, to be dropped as lost.

        A block whose move was refused (a quantised tier cannot encode it) or whose source
        proved unreadable is not lost while its durable copy is stored below: the move takes
        the copy up as it is (no write, counted in the engine's ``taken_up``), so the block
        stays readable, durable, and is not counted lost. Invariants: a block falls back
        only into a free slot of its copy's tier (``prepare_move``); one that cannot (no free
        slot, still moving) is returned, dropped as before. An engine that retains nothing
        (a replay's) returns ``lost`` unchanged.
        """
        retained = getattr(self.engine, "retained", None)
        for below in range(tier + 1, len(self.dirs)):
            if not lost or retained is None:
                break
            copies = set(retained.held_in(below))
            back = [block_id for block_id in lost if block_id in copies]
            if back and self._transfer(back, tier, below, False, None):
                lost = [block_id for block_id in lost if block_id not in copies]
        return [block_id for block_id in lost if block_id in self.dirs[tier].slot_of]

    def _drop_lost(self, tier: int, ids: list[int]) -> None:
        """Drops blocks whose stored bytes proved unreadable. References and holds on those
        that left the hierarchy (no copy in another tier) end, kept as orphan counts: each
        reader's unref and each sequence's release still balances, and none takes a count on
        the block stored anew (``HoldMixin``). A block with a copy left keeps both."""
        if not ids:
            return
        self._hooks[tier].on_remove(ids)
        self.engine.discard(tier, ids, self.dirs[tier].remove(ids))
        for block_id in ids:
            if self.locate(block_id) is not None:
                continue
            if block_id in self.refs:  # readers keep their counts (added to any older ones): unref still balances
                self.orphan_refs[block_id] = self.orphan_refs.get(block_id, 0) + self.refs.pop(block_id)
            self._orphan_holds(block_id)  # a live sequence lost a block: it sees it gone
        self.events.emit(Ev.LOST, tier, len(ids))
        if self.events.records_departures:
            self._report_departed(ids)

    @staticmethod
    def _see_future(future: dict[int, int] | None, ids: Sequence[int], hints: Hints | None, a: int, b: int) -> None:
        """Records the next use of ``ids[a:b]`` as they are accessed, not before: a block
        that a later id of the same request pushes down still carries the use it is about
        to get (its next use as last seen), so a lower tier's Belady does not take it for dead."""
        if future is not None:
            future.update(zip(ids[a:b], hints.next_use[a:b]))

    def _forget_departed(self) -> None:
        """Forgets the future of dropped blocks that are still out of the hierarchy.

        Not at the drop itself: a block of the request being served, dropped before its turn,
        comes back as a miss with its next use recorded only at its segment's start
        (``_see_future``), and a later id of the request may push it down again; its future
        must survive until then. Forgetting after the access changes no value ever read:
        a block is read from ``_future`` only while resident, and re-entering the hierarchy
        records it first.
        """
        if self._future is None or not self._departed:
            return
        for block_id in self._departed:
            if self.locate(block_id) is None:
                self._future.pop(block_id, None)
        self._departed.clear()

    def _move_hints(self, ids: Sequence[int], parents: Mapping[int, int | None] | None) -> Hints | None:
        """Hints for blocks moved between tiers: their known next use (``_future_hints``),
        and their parents where ``parents`` gives them."""
        future = self._future_hints(ids)
        if parents is None:
            return future
        return Hints(0, None if future is None else future.next_use, [parents.get(b) for b in ids])

    def _future_hints(self, ids: Sequence[int]) -> Hints | None:
        """Hints for blocks moved between tiers: their known next use, when tracked."""
        if self._future is None:
            return None
        future = self._future
        return Hints(0, [future.get(b, NO_NEXT_USE) for b in ids], None)

    def _report_departed(self, ids: Sequence[int]) -> None:
        """Tells the event log which of ``ids`` no tier holds any more (callers check that
        it records departures: replays do not, and pay nothing here)."""
        self.events.departed([b for b in ids if self.locate(b) is None])


def _move_kind(plan: TransferPlan) -> Ev:
    if plan.keep_source and plan.dst_tier > plan.src_tier:
        return Ev.COPY
    return Ev.PROMOTE if plan.dst_tier < plan.src_tier else Ev.DEMOTE
