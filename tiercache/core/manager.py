"""The tier manager: residency, ownership and movement of blocks across a hierarchy.

Metadata plane only. The same manager runs live (with a data-plane engine) and in the
simulator (with ``SimEngine``); only the injected engine differs.

Hierarchy: tiers ordered fastest first. Exclusive (default): a block lives in at most one
tier; a victim of tier ``t`` is demoted to ``t + 1`` (if that tier admits it; past it when it
cannot make room) and a victim of the last tier leaves the hierarchy (the cascade:
``tiercache.core.room``); a hit below the top is promoted to the top, or read where it lies
when the run does not fit there or the tiers on its victims' way down cannot take them (a
placement policy may store new blocks lower down, or read a hit where it lies instead). A
block a prefix read recomputes, or a writer stores again from its bytes (``store_fresh``), moves
to the top tier without a transfer, never loaded from below. Write-through (inclusive): a new
block is copied to every lower tier that admits it; victims are dropped from their tier only; a
hit below the top is copied up.

Ordering: with one tier, ``access`` is exactly equivalent to handling its ids one at a time,
in order (it batches runs of hits and, for policies whose ``batch_insert_safe`` is True, runs
of misses), which is what makes LRU/FIFO/Belady agree with libCacheSim. In a hierarchy, a run
of consecutive ids found in the same lower tier is promoted as one plan (one copy per request
segment, as a serving engine fetches a prefix), so the blocks of that run never displace each
other; one id per call is exactly the one-at-a-time semantics (tested against a plain model).

Room in the top tier is made before a promoted block leaves its tier: when every tier is
full, a promotion from tier ``i`` can push one block out of the last tier even though the
promoted block then frees a slot in tier ``i`` (a hole the next demotion fills without a
drop). The bytes never need a staging buffer this way. Such a drop, a declined promotion
and a run promoted as one plan all depart from one LRU of the hierarchy's total size, so an
exclusive LRU hierarchy need not miss as often as that LRU: on the bundled sample trace (object
semantics) HBM 1,000 + DRAM 4,000 + NVMe 16,000 misses 51,055 times, one LRU of 21,000 blocks
50,991 (some small traces miss less in the hierarchy). When the tiers on the victims' way
down cannot give up enough victims because they hold the promoted run itself (or pinned or
referenced blocks), the promotion is declined and the run read in place, instead of pushing
those victims out of the hierarchy while a tier below them still has room. While any tier
has a free slot, a run whose promotion would push a block out of the last tier (only because
the run still holds its own slots) moves in pieces instead, the first as large as the free
slots, each leaving the room the next one needs: then nothing leaves.

Shared last tier (``shared_last``, the live store's remote tier): the last tier is this
manager's view of a store other processes write to. It may hold a block a local tier holds
too (a published copy: ``publish``), copies into it are allowed in an exclusive hierarchy, a
victim it already holds just leaves its local tier, and a write into it that fails drops the
victims as an eviction would: a remote failure never blocks a local placement.
"""

from __future__ import annotations

from typing import Sequence

from tiercache.policies.base import AdmissionPolicy, EvictionPolicy, Hints, PlacementPolicy

from .answers import askers, hooks
from .counts import CountError, decrement, increment
from .directory import TierDirectory
from .engine import ImmediateEngine, TransferEngine
from .guards import distinct_prefix, pick_hints, slice_hints
from .holds import HoldMixin, orphans_first
from .inserting import InsertMixin
from .placing import check_placement, promotes
from .plans import Ev, EventLog, Room, TransferPlan
from .room import _MADE, RoomMixin
from .transfers import TransferMixin

__all__ = ["TierManager", "CountError", "Room"]


class TierManager(InsertMixin, RoomMixin, TransferMixin, HoldMixin):
    """Blocks, tiers, policies, new blocks stored (``InsertMixin``), the demotion cascade
    (``RoomMixin``), two-phase transfers (``TransferMixin``) and live sequences' holds
    (``HoldMixin``).

    Invariants (``check_invariants``): each tier's directory is consistent and holds exactly
    the ids its eviction policy tracks; in exclusive mode no id is in two tiers; reference
    counts are positive and only on resident ids; holds as ``HoldMixin`` states; every
    in-flight plan's sources are pinned. A policy is never handed a sequence the manager
    uses after the call unless it is tiercache's own (``tiercache.core.answers.hooks``).
    """

    def __init__(
        self,
        tiers: Sequence[tuple[str, int]],
        evictions: Sequence[EvictionPolicy],
        admissions: Sequence[AdmissionPolicy],
        engine: TransferEngine | None = None,
        events: EventLog | None = None,
        write_through: bool = False,
        shared_last: bool = False,
        placement: PlacementPolicy | None = None,
    ) -> None:
        if not (len(tiers) == len(evictions) == len(admissions)) or not tiers:
            raise ValueError("one eviction and one admission policy per tier, at least one tier")
        check_placement(placement, write_through, shared_last)
        self.dirs = [TierDirectory(name, cap) for name, cap in tiers]
        self.policies, self.admissions = list(evictions), list(admissions)
        self._victims, self._admit = askers(self.policies, self.admissions, self.dirs)  # out-of-tree: checked
        self._hooks = [hooks(p) for p in self.policies]  # out-of-tree: handed copies of what the manager reuses
        self.engine = engine if engine is not None else ImmediateEngine()
        self.events = events if events is not None else EventLog()
        self.write_through = write_through
        self.placement = placement  # where new blocks and hits below the top go (None: the top)
        #: Index of the shared last tier (see the module docstring), or None.
        self.shared: int | None = len(tiers) - 1 if shared_last and len(tiers) > 1 else None
        self.refs: dict[int, int] = {}
        # Blocks of live sequences: they may move between tiers but never leave the
        # hierarchy (the last tier never picks them as victims).
        self.held: dict[int, int] = {}
        self.orphan_holds: dict[int, int] = {}  # holds of blocks lost while held (``HoldMixin``)
        self.orphan_refs: dict[int, int] = {}  # references held on blocks lost (unreadable) while referenced
        self.left_for_shared: dict[tuple[int, int], int] = {}  # per (tier, shared): victims it already held (no copy)
        self.inflight: dict[int, TransferPlan] = {}
        self._running: set[int] = set()  # in-flight jobs this manager submitted (start_move)
        self._may_block = True  # False while a prefetch makes room: no waiting for moves in flight
        self._pass_full = False  # True inside passing_full_tiers: guarded victims pass a full tier
        self._kept: frozenset = frozenset()  # ids of an access with keep_all: never last-tier victims
        # Write-through: ids whose copy down failed (a full or failing disk, ``_note_uncopied``);
        # such a victim moves down instead of leaving (``_let_go``).
        self._uncopied: set[int] = set()
        # Promotions move in pieces when the run holds its own room (``_promote``): in an exclusive
        # hierarchy whose last tier is its own (a shared tier's victims only leave the view).
        self._stages = not write_through and self.shared is None and len(tiers) > 1
        self._plan_hints: dict[int, Hints | None] = {}
        self._next_job = 0
        self._no_extra: frozenset = frozenset()
        # Next-use times seen in hints, kept only when an offline policy needs them, so a
        # block demoted or promoted carries its future into the other tier's policy.
        self._future: dict[int, int] | None = {} if any(p.needs_future for p in evictions) else None
        self._departed: list[int] = []  # dropped blocks whose future goes when the access ends (_forget_departed)
        # Largest batch-safe insert chunk into each tier: the smallest capacity from it down.
        self._chunk_caps = [min(d.capacity for d in self.dirs[t:]) for t in range(len(self.dirs))]

    # -- queries -------------------------------------------------------------------------
    @property
    def n_tiers(self) -> int:
        """Number of tiers."""
        return len(self.dirs)

    def locate(self, block_id: int) -> int | None:
        """Index of the fastest tier holding ``block_id``, or None."""
        for index, directory in enumerate(self.dirs):
            if block_id in directory.slot_of:
                return index
        return None

    def prefix_length(self, ids: Sequence[int]) -> int:
        """Number of leading ids resident in some tier (the longest cached prefix)."""
        maps = [d.slot_of for d in self.dirs]
        for position, block_id in enumerate(ids):
            if not any(block_id in m for m in maps):
                return position
        return len(ids)

    # -- reader references ---------------------------------------------------------------
    def ref(self, ids: Sequence[int]) -> None:
        """Counts one more reader of each resident id; referenced ids are never victims."""
        for block_id in ids:
            if self.locate(block_id) is None:
                raise KeyError(f"ref of block {block_id}, which is not resident")
        increment(self.refs, ids)

    def note_next_uses(self, ids: Sequence[int], uses: Sequence[int]) -> None:
        """Records the next use of each of ``ids`` stored or refreshed outside ``access`` (a
        step trace's writes), where ``access`` records a read's, so a lower tier's offline
        policy is told the same future as the top's. Nothing unless a policy needs the future."""
        if self._future is not None:
            self._future.update(zip(ids, uses))

    def unref(self, ids: Sequence[int]) -> None:
        """Undoes ``ref``; raises CountError below zero (never clamps).

        References on a block that was lost while referenced are released from
        ``orphan_refs`` first, each repeat of an id spending one, then from ``refs``
        (``orphans_first``, as holds): readers' counts stay balanced, and a block pinned
        before its loss and again once stored anew is released by one call naming it twice.
        """
        orphans, live = orphans_first(ids, self.orphan_refs)
        decrement(self.refs, live, "unref")
        decrement(self.orphan_refs, orphans, "unref")

    # -- the access path -----------------------------------------------------------------
    def access(self, ids: Sequence[int], hints: Hints | None = None, count_hits: bool = True, store_misses: bool = True,
               wait: bool = True, promote: bool = True, keep_all: bool = False) -> list[TransferPlan]:
        """Reads ``ids`` in order: hits are touched (and promoted), misses computed and stored.

        With ``wait`` (default) every promotion completes before the call returns, and the
        result is exactly the one-at-a-time semantics described in the module docstring.
        With ``wait`` False promotions are started and left in flight: the returned plans are
        the handles (``wait(plan.job_id)``, or ``poll``); until they complete, their blocks
        are found in the tier they came from and their unreadable copies (if any) are
        counted as lost, not as misses. Demotions that make room always complete first.

        With ``count_hits`` False (prefix semantics after the first miss) every id counts as a
        miss and resident ones also as recomputed: one in the top tier is refreshed there,
        one below moves to the top tier with no transfer (the engine wrote it there), or
        stays where it lies (``_recompute_below``). With
        ``store_misses`` False misses are counted but not stored (a reader that has no bytes
        for them, such as the live store's ``get``). A hit whose stored copy proves unreadable
        on promotion is dropped and counted as a miss.

        With ``promote`` False hits below the top tier are read where they are (a streaming
        reader such as exact attention over a whole sequence): they are touched in their
        own tier's policy and counted as hits there, read in place, and nothing moves.

        With ``keep_all`` no id of the call leaves the hierarchy while it runs, as if held
        (``hold``): they may move down, never out. A serving engine pins the matched prefix
        while it serves it, so each of its blocks is a hit, none pushed out by the promotion
        of another.
        """
        if keep_all:
            self._kept = frozenset(ids)
            try:
                return self.access(ids, hints, count_hits, store_misses, wait, promote)
            finally:
                self._kept = frozenset()
        future = None if hints is None or hints.next_use is None else self._future
        started: list[TransferPlan] | None = None if wait else []
        top = self.dirs[0].slot_of
        n, i = len(ids), 0
        while i < n:
            j = i
            while j < n and ids[j] in top:
                j += 1
            if j > i:
                self._see_future(future, ids, hints, i, j)
                self._touch_top(ids[i:j], slice_hints(hints, i, j), count_hits)
                if j == n:
                    break
            k = j + 1
            while k < n and ids[k] not in top:
                k += 1
            k = j + distinct_prefix(ids, j, k)
            self._see_future(future, ids, hints, j, k)
            self._bring_up(ids[j:k], slice_hints(hints, j, k), count_hits, store_misses, started, promote)
            i = k
        self._forget_departed()
        return started or []

    def insert(self, ids: Sequence[int], hints: Hints | None = None, hold: bool = False) -> None:
        """Stores newly computed blocks, absent from every tier, in the top tier.

        With ``hold`` each block is held (``hold``) the moment it is placed, so a later
        chunk of the same insert can push it down but never out.
        """
        for block_id in ids:
            if self.locate(block_id) is not None:
                raise KeyError(f"insert of block {block_id}, which is already resident")
        self._insert_new(list(ids), hints, hold)

    def restore(self, tier: int, ids: Sequence[int], slots: Sequence[int] | None = None) -> None:
        """Adopts blocks already stored in ``tier`` (reopening a durable store).

        ``slots`` names the (free) slots they occupy, or None to count them in any free
        slots (a medium that places bytes itself). The ids must be absent from every tier
        and fit; nothing is moved.
        """
        for block_id in ids:
            if self.locate(block_id) is not None:
                raise KeyError(f"restore of block {block_id}, which is already resident")
        if slots is None:
            self.dirs[tier].insert(ids)
        else:
            self.dirs[tier].claim(ids, slots)
        self._hooks[tier].on_insert(list(ids), self._future_hints(ids))
        self.events.emit(Ev.INSERT, tier, len(ids))

    def _touch_top(self, run: Sequence[int], hints: Hints | None, count_hits: bool) -> None:
        self._hooks[0].on_access(run, hints)
        self._count_found(0, len(run), count_hits)

    def _count_found(self, tier: int, count: int, count_hits: bool) -> None:
        if count_hits:
            self.events.emit(Ev.HIT, tier, count)
        else:
            self.events.emit(Ev.MISS, tier, count)
            self.events.emit(Ev.RECOMPUTE, tier, count)

    def _bring_up(self, run: Sequence[int], hints: Hints | None, count_hits: bool, store_misses: bool,
                  started: list | None, promote: bool = True) -> None:
        """Handles a run of distinct ids absent from the top tier, in order. One that a move in
        flight brought to the top meanwhile (room made for an earlier segment waits for moves
        out of a full last tier: ``tiercache.core.room``) is found there."""
        if len(self.dirs) == 1:
            self._miss(run, hints, store_misses)
            return
        position = 0
        while position < len(run):
            tier = self.locate(run[position])
            end = position + 1
            while end < len(run) and self.locate(run[end]) == tier:
                end += 1
            segment, seg_hints = run[position:end], slice_hints(hints, position, end)
            if tier is None:
                self._miss(segment, seg_hints, store_misses)
            elif tier == 0:
                self._touch_top(segment, seg_hints, count_hits)
            else:
                self._found_below(segment, tier, seg_hints, count_hits, store_misses, started, promote)
            position = end

    def _miss(self, ids: Sequence[int], hints: Hints | None, store_misses: bool) -> None:
        self.events.emit(Ev.MISS, 0, len(ids))
        if store_misses:
            self._insert_new(ids, hints)

    def _found_below(self, ids: Sequence[int], tier: int, hints: Hints | None, count_hits: bool, store_misses: bool,
                     started: list | None, promote: bool = True) -> None:
        """Promotes ids found in a lower tier, or reads them in place without ``promote`` or when the
        placement says so (``READ_IN_PLACE``: no promotion tried, none skipped); ids whose copy proved
        unreadable are misses. Without ``count_hits``: recomputed (``_recompute_below``), no link crossed."""
        if not count_hits:
            self._recompute_below(ids, tier, hints, store_misses)
            return
        if not (promote and promotes(self.placement, ids, tier, hints)):
            self._hooks[tier].on_access(ids, hints)
            self.events.emit(Ev.READ_IN_PLACE, tier, len(ids))
            self._count_found(tier, len(ids), count_hits)
            return
        self._hooks[tier].on_access(ids, hints)
        guard_ids = frozenset(ids)  # the whole segment, through every piece
        start = 0
        while start < len(ids):
            end, lost = self._promote(ids, start, tier, hints, guard_ids, started)
            self._count_found(tier, end - start - len(lost), count_hits)
            if lost:
                gone = set(lost)
                positions = [p for p in range(start, end) if ids[p] in gone]
                self._miss(lost, None if hints is None else pick_hints(hints, positions), store_misses)
            start = end

    def _recompute_below(self, ids: Sequence[int], tier: int, hints: Hints | None, store_misses: bool) -> None:
        """Ids found in ``tier`` by a read that recomputes them (prefix semantics after the
        first miss): misses, counted as recomputed, never loaded from ``tier``.

        The engine writes fresh KV into the top tier. With ``store_misses`` the block moves
        there without a transfer (``_renew_at_top``), room made first as for a promotion: the
        fresh copy is published, then the stale one released (kept in write-through), and no
        event but the recompute is counted, since the block neither entered nor left the
        hierarchy. It stays where it lies, touched, when no room can be
        made that way, when a placement policy stores new blocks lower down, when a move in
        flight pins it, and without ``store_misses`` (a reader with no bytes to store). A copy
        in the shared tier stays (valid, and other processes'); the fresh block is stored
        above it as a new one (a local copy beside it is allowed).
        """
        self._count_found(tier, len(ids), False)
        if tier == self.shared:
            if store_misses:
                self._insert_new(ids, hints)
            return
        if not (store_misses and self._renew_at_top(ids, tier, hints)):
            self._hooks[tier].on_access(ids, hints)

    # -- promotion -----------------------------------------------------------------------
    def _promote(self, ids: Sequence[int], start: int, tier: int, hints: Hints | None, guard_ids: frozenset,
                 started: list | None) -> tuple[int, list[int]]:
        """Brings hits ``ids[start:]`` of ``tier`` up to the top tier in one move, or only the
        first of them when the hierarchy has fewer free slots than the run, but some (its
        cascade would push a block out only because the run holds its own slots:
        ``tiercache.core.room``): as many as there are free slots, whose move frees the room
        the next piece needs; if no room can be made they stay (counted).

        Returns the end of the piece handled and the ids of it that left the hierarchy because
        their stored copy was unreadable. With ``started`` (a list) the move of the last piece
        is left in flight and its plan appended there.
        """
        n = len(ids) - start
        if self._stages and n > 1:
            n = min(n, self._free_slots()) or n  # with no free slot at all, the victims leave
        room = self._make_room(0, n, guard_ids)
        end = start + n
        piece = ids[start:end]
        room_made = room is _MADE or self._retry_room(0, n, guard_ids)
        pending = started if end == len(ids) else None  # a piece lands before the next: it frees their room
        if room_made and self._transfer(piece, tier, 0, self.write_through, slice_hints(hints, start, end), pending):
            return end, []
        self.events.emit(Ev.PROMOTE_SKIPPED, tier, n)
        return end, [block_id for block_id in piece if self.locate(block_id) is None]

    # -- explicit removal ----------------------------------------------------------------
    def evict(self, ids: Sequence[int]) -> None:
        """Drops resident, unreferenced, unpinned ids from every tier holding them (an id
        named twice is dropped once)."""
        ids = list(dict.fromkeys(ids))
        for block_id in ids:
            if block_id in self.refs:
                raise CountError(f"evict of block {block_id}, which has readers")
            if block_id in self.held:
                raise CountError(f"evict of block {block_id}, which a live sequence holds")
        for tier, directory in enumerate(self.dirs):
            present = [b for b in ids if b in directory.slot_of]
            if present:
                self._drop(tier, present)

    def drop_copies(self, tier: int, ids: Sequence[int]) -> list[int]:
        """Drops the copies in ``tier`` of those ``ids`` another tier holds too (a published
        copy found stale), unless pinned there by a move; each block stays where else it
        lies, so no event is counted (an eviction is a block leaving the hierarchy; the caller
        counts what it dropped). Returns the ids whose copy was dropped."""
        here, pins = self.dirs[tier].slot_of, self.dirs[tier].pins
        elsewhere = [d.slot_of for t, d in enumerate(self.dirs) if t != tier]
        dropped = [b for b in dict.fromkeys(ids) if b in here and b not in pins and any(b in s for s in elsewhere)]
        if dropped:
            self._hooks[tier].on_remove(dropped)
            self.engine.discard(tier, dropped, self.dirs[tier].remove(dropped))
        return dropped

    # -- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Asserts every structure is consistent (see the class docstring)."""
        for directory, policy in zip(self.dirs, self.policies):
            directory.check_invariants()
            policy.check_invariants()
            assert len(policy) == len(directory), f"{directory.name}: policy tracks {len(policy)}, tier holds {len(directory)}"
            assert all(b in policy for b in directory.slot_of), f"{directory.name}: policy misses a resident block"
        if not self.write_through:
            seen: set[int] = set()
            for directory in self.dirs[: self.shared]:  # a shared tier may hold copies
                assert seen.isdisjoint(directory.slot_of), "exclusive mode: a block is in two tiers"
                seen.update(directory.slot_of)
        for block_id, count in self.refs.items():
            assert count > 0 and self.locate(block_id) is not None, f"bad reference on {block_id}"
        self._check_holds()
        for block_id, count in self.orphan_refs.items():  # the block may be resident again (stored anew)
            assert count > 0, f"bad orphan reference on {block_id}"
        for plan in self.inflight.values():
            assert all(b in self.dirs[plan.src_tier].pins for b in plan.ids), "in-flight source not pinned"
        assert self._running <= set(self.inflight), "a running job is not in flight"

