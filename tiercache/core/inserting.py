"""Storing new blocks: the insert path of ``TierManager`` (split out to keep modules small).

New blocks go to the top tier, or to the tier a placement policy names, admission
permitting. Room is made first, chunk by chunk (``_insert_chunks``): a policy whose
``batch_insert_safe`` is True places each chunk at once, any other one id at a time after
those the free slots take, one eviction per insert as sequential code does; both leave the
same state, and the transfers of one chunk are charged as one per link either way
(``coalesced``). Where room can be made for fewer blocks than a chunk holds (slots pinned,
referenced or held) it is cut into pieces of what fits (``_place_in_pieces``); only blocks no
room can be made for are refused, counted. In write-through every new block is then copied to
each lower tier that admits it (``_copy_down``).

A writer that computed again blocks the hierarchy already holds (``store_fresh``: a live
store's ``put`` of stored keys) stores them at the top from its bytes, with no load: as a
recomputed block of a prefix read moves up (``_renew_at_top``), never read from below.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Mapping, Sequence

from tiercache.policies.base import Hints

from .counts import increment
from .engine import coalesced
from .guards import pick_hints, slice_hints
from .placing import insert_tier
from .plans import Ev
from .room import _MADE

__all__ = ["InsertMixin"]


class InsertMixin:
    """The insert path of ``TierManager`` (see the module docstring).

    Relies on the manager's ``dirs``, ``policies``, ``_hooks``, ``_admit``, ``placement``,
    ``engine``, ``events``, ``held``, ``write_through``, ``shared``, ``_no_extra``,
    ``_chunk_caps`` and ``locate``, on ``_make_room``, ``_retry_room``, ``_room_possible`` and
    ``_place_in_pieces`` (``RoomMixin``) and on ``_transfer``, ``inflight``, ``_running`` and
    ``wait`` (``TransferMixin``).
    """

    def store_fresh(self, ids: Sequence[int], parents: Mapping[int, int | None] | None = None) -> list[int]:
        """Stores blocks whose bytes a writer just computed (staged in the engine: a live store's
        ``put``), in call order, in runs of one tier, at the top tier and with no load:

        - absent, or listed only by the shared tier (a view entry nobody checked): inserted as new
          blocks (counted ``INSERT``); a view entry whose block then has a local copy leaves the
          view (``_leave_view``), so a publication writes the block again;
        - held in a lower local tier: moved to the top without a transfer (``_renew_at_top``),
          counted nothing, the stale copy released (kept in write-through); touched where it
          lies when no room can be made at the top (or a copy in flight pins it);
        - held in the top tier: touched there (a refresh: nothing moves or is read).

        A move in flight taking one of them out of its tier (a prefetch) is completed first,
        so the block is found where it landed, or, lost on the way, stored anew. ``parents``
        (optional) gives each id its prefix-tree parent, handed to the policies with it
        (``request_hints``: a put's keys, as a read gives them). Returns the ids whose view
        entries left the view (stored locally from the writer's bytes)."""
        self._settle_moves_of(ids)
        local_tiers = self.shared if self.shared is not None else len(self.dirs)
        position, left_view = 0, []
        while position < len(ids):
            tier = _local_tier(self.locate(ids[position]), local_tiers)  # a view entry alone is no local copy
            end = position + 1
            while end < len(ids) and _local_tier(self.locate(ids[end]), local_tiers) == tier:
                end += 1
            run = ids[position:end]
            left_view += self._store_fresh_run(run, tier, None if parents is None else Hints(
                parents=[parents.get(b) for b in run]))
            position = end
        return left_view

    def _store_fresh_run(self, run: Sequence[int], tier: int | None, hints: Hints | None) -> list[int]:
        """``store_fresh`` of a run held in local ``tier`` (None: in no local tier), with its
        ``hints``; returns the ids whose view entries left the view."""
        if tier is None:
            # The view entries leave first: the call's bytes replace them, and an insert cascading
            # out of the local tiers must write its block to the shared tier (a value a view entry
            # names may be gone), never drop the local copy on the strength of that entry.
            left = self._leave_view(run, unconditionally=True)
            self._insert_new(run, hints)
            return left + self._leave_view(run)
        if tier == 0 or not self._renew_at_top(run, tier, hints):
            self._hooks[tier].on_access(run, hints)
        return []

    def _settle_moves_of(self, ids: Sequence[int]) -> None:
        """Completes the moves (not copies) in flight that this manager started for any of ``ids``."""
        wanted = set(ids)
        for job_id in [j for j, plan in self.inflight.items()
                       if j in self._running and not plan.keep_source and not wanted.isdisjoint(plan.ids)]:
            self.wait(job_id)

    def _leave_view(self, ids: Sequence[int], unconditionally: bool = False) -> list[int]:
        """Entries of the shared tier whose blocks ``ids`` now have a local copy (any entry of
        ``ids`` when ``unconditionally``: blocks about to be stored from a writer's bytes, but
        those a reader references or a sequence holds, whose entry must stay if the insert is
        refused) leave it (the value stays in the store for the others; a pinned entry stays),
        counted nothing. Returns their ids."""
        if self.shared is None:
            return []
        view = self.dirs[self.shared]
        gone = [b for b in ids if b in view.slot_of and b not in view.pins
                and (self.locate(b) != self.shared
                     or (unconditionally and b not in self.refs and b not in self.held))]
        if gone:
            self._hooks[self.shared].on_remove(gone)
            self.engine.discard(self.shared, gone, view.remove(gone))
        return gone

    def _renew_at_top(self, ids: Sequence[int], tier: int, hints: Hints | None) -> bool:
        """Moves ``ids``, held in the lower local ``tier``, to the top tier from fresh bytes the
        engine holds (a recomputed block, a writer's), without a transfer: room made first, as
        for a promotion (never at the expense of ``ids``), the fresh copy published
        (``_fill_and_publish``, not counted: the block neither entered nor left the hierarchy),
        then the stale one released (kept in write-through). False, nothing done, when a
        placement policy stores new blocks lower down, a move in flight pins one of them, or no
        room can be made."""
        pins, guard = self.dirs[tier].pins, frozenset(ids)
        if insert_tier(self.placement, ids, hints, len(self.dirs)) != 0 or any(b in pins for b in ids):
            return False
        if self._make_room(0, len(ids), guard) is not _MADE and not self._retry_room(0, len(ids), guard):
            return False
        self._fill_and_publish(ids, hints, 0, counted=False)
        if not self.write_through:  # an inclusive hierarchy keeps its lower copies
            self._hooks[tier].on_remove(ids)
            self.engine.discard(tier, ids, self.dirs[tier].remove(ids))
        return True

    def _insert_new(self, ids: Sequence[int], hints: Hints | None, hold: bool = False) -> None:
        """Places new blocks in the top tier (or the placement's), admission permitting, making room
        first, in chunks (``_insert_chunks``), cut smaller where fewer slots can be freed
        (``_place_in_pieces``); only blocks no room can be made for are refused, counted."""
        tier = insert_tier(self.placement, ids, hints, len(self.dirs))
        admitted = self._admit[tier](ids)
        if not all(admitted):
            self.events.emit(Ev.REFUSED, tier, admitted.count(False))
            keep = [p for p, ok in enumerate(admitted) if ok]
            ids = [ids[p] for p in keep]
            hints = None if hints is None else pick_hints(hints, keep)
        place = partial(self._place_new, ids, hints, tier, hold)
        fit = partial(self._room_possible, tier, self._no_extra)  # what room can be made for: the unpinned slots
        for a, b in self._place_chunks(tier, len(ids), place, fit):
            self.events.emit(Ev.REFUSED, tier, b - a)  # no room: every slot pinned, referenced or held, or a write-back failed

    def _place_new(self, ids: Sequence[int], hints: Hints | None, tier: int, hold: bool, a: int, b: int) -> bool:
        """Makes room for new blocks ``ids[a:b]`` in ``tier`` and stores them there (held, with
        ``hold``; copied down in write-through); False, nothing stored, when no room was made."""
        chunk, chunk_hints = ids[a:b], slice_hints(hints, a, b)
        if self._make_room(tier, b - a, self._no_extra) is not _MADE and not self._retry_room(tier, b - a, self._no_extra):
            return False
        self._fill_and_publish(chunk, chunk_hints, tier)
        if hold:
            increment(self.held, chunk)
        if self.write_through:
            self._copy_down(chunk, chunk_hints)
        return True

    def _fill_and_publish(self, ids: Sequence[int], hints: Hints | None, tier: int = 0, counted: bool = True) -> None:
        """Writes new blocks into reserved slots of ``tier`` (the top by default), then publishes
        them (an ``INSERT``, unless not ``counted``: a recomputed block moving up).

        Publish only what has landed: the slots stay reserved (invisible) while the engine
        writes the bytes, and any exception from the engine (KeyboardInterrupt included)
        returns them to the free stack and propagates, leaving no trace of the blocks.
        """
        directory = self.dirs[tier]
        slots = directory.reserve(len(ids))
        try:
            self.engine.fill(tier, ids, slots)
        except BaseException:
            directory.release(slots)
            raise
        directory.publish(ids, slots)
        self._hooks[tier].on_insert(ids, hints)
        if counted:
            self.events.emit(Ev.INSERT, tier, len(ids))

    def _place_chunks(self, tier: int, n: int, place: Callable[[int, int], bool],
                      fit: Callable[[], int]) -> list[tuple[int, int]]:
        """Places new blocks ``[0, n)`` in ``tier`` chunk by chunk (``_insert_chunks``), each
        chunk at once for a batch-safe policy, else one id at a time after those the free
        slots take (``_one_at_a_time``: one eviction per insert, as sequential code does);
        returns the pieces refused (``_place_in_pieces``).

        The transfers of one chunk's pieces are charged as one per link (``coalesced``), as
        the batch-safe policy's single placement is: the same moves cost the same modeled
        time whatever the policy's ``batch_insert_safe``, a permission to batch.
        """
        chunks = self._insert_chunks(tier, n)
        if self.policies[tier].batch_insert_safe:
            return self._place_in_pieces(chunks, place, fit)
        free, refused = self.dirs[tier].n_free, []
        for a, b in chunks:
            with coalesced(self.engine):
                refused += self._place_in_pieces(_one_at_a_time(a, b, free if a == 0 else 0), place, fit)
        return refused

    def _insert_chunks(self, tier: int, n: int) -> list[tuple[int, int]]:
        """Splits n inserts into the chunks a batch-safe policy places at once, which equals
        inserting them one at a time: up to the capacity of the smallest tier from ``tier``
        down (so a chunk's victims never outnumber the slots of a tier on their way down,
        which would push them all out: ``tiercache.core.room``), the first as large as the
        free slots when they are more.
        """
        if n == 0:
            return []
        step = self._chunk_caps[tier]
        first = max(min(n, self.dirs[tier].n_free), min(n, step))
        return [(0, first), *((a, min(a + step, n)) for a in range(first, n, step))]

    def _copy_down(self, ids: Sequence[int], hints: Hints | None) -> None:
        """Write-through: copies new top-tier blocks into every lower tier that admits them
        and has room made; those whose copy failed (a full or failing disk) are remembered
        (``_note_uncopied``)."""
        for tier in range(1, len(self.dirs)):
            if tier == self.shared:  # publishing to a shared tier is its owner's decision
                continue
            admitted = self._admit[tier](ids)
            wanted = [b for b, ok in zip(ids, admitted) if ok and b not in self.dirs[tier].slot_of]
            self.events.emit(Ev.REFUSED, tier, admitted.count(False))
            if not wanted:
                continue
            if self._make_room(tier, len(wanted), frozenset(wanted)) is not _MADE:
                continue  # no room (a tier full of held blocks): a state, not a failure; nothing noted
            if not self._transfer(wanted, 0, tier, keep_source=True, hints=hints if len(wanted) == len(ids) else None):
                here = self.dirs[tier].slot_of
                self._note_uncopied([b for b in wanted if b not in here])

    def _note_uncopied(self, ids: list[int]) -> None:
        """Remembers write-through blocks whose copy down failed, for
        ``_let_go``. Ids no tier holds any more are pruned once the set outgrows the
        hierarchy's slots, so it stays within about twice their number."""
        if not ids:
            return
        self._uncopied.update(ids)
        if len(self._uncopied) > 2 * sum(d.capacity for d in self.dirs) + 64:
            self._uncopied = {b for b in self._uncopied if self.locate(b) is not None}


def _one_at_a_time(a: int, b: int, free: int) -> list[tuple[int, int]]:
    """Chunk ``[a, b)`` in the pieces sequential inserts make: first as many ids as ``free``
    slots take (at least one), then one id each."""
    first = a + max(min(b - a, free), 1)
    return [(a, first), *((x, x + 1) for x in range(first, b))]


def _local_tier(tier: int | None, local_tiers: int) -> int | None:
    """``tier`` when it is a local one (below ``local_tiers``, the shared tier's index), else None."""
    return tier if tier is not None and tier < local_tiers else None
