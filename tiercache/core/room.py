"""Making room in a tier: the demotion cascade of ``TierManager`` (split out to keep modules small).

A tier that must free slots asks its eviction policy for victims. Victims of an exclusive
tier move down; victims of the last tier (of every tier in write-through mode) leave the
hierarchy. Where the victims go:

- to the tier right below, whose own victims cascade further down first;
- when that tier cannot give up enough victims (its blocks are pinned, referenced or held,
  or the victims outnumber its slots) and the placement guards nothing, to the nearest
  tier further down that can take them; they leave the hierarchy only when no tier below
  can take them;
- when held victims (a live sequence's, or read by a ``keep_all`` access: they may not
  leave) of an unguarded placement find no room below (every tier below full of blocks
  that may not leave), the room is made a slot at a time instead, each slot from the
  policy's victim or, where that one cannot move down, from a block of the tier that may
  leave, which then leaves (``_demote_leavable``): such a placement is refused only when
  no block on its way down may leave (pinned, referenced or held), never for a held
  victim while a block that may leave sits in a tier on its way down;
- when the placement guards blocks (``protected``: a promotion or a prefetch, whose run
  may be exactly what fills the tier below), the whole placement is declined instead
  (``Room.NO_VICTIMS``, no block has moved): the caller reads the run where it lies. A
  block is never pushed out of the hierarchy to make room for one it already holds while
  a tier below still has room. A caller that needs the run in the top tier, where reading
  it in place is no answer (a live store's ``get_slots`` and ``prefetch``), makes its room
  inside ``passing_full_tiers()``: the victims then pass that tier to the nearest further
  down that can make room for them, as an unguarded placement's do; they leave the
  hierarchy only as the rules below allow (with every tier full, the last tier's victims
  leave, as for any promotion, and the run's old slots are the holes). A replay never does
  (its reads in place are the model, and the compiled chain, ``tiercache.sim.chain``,
  mirrors the default);
- a guarded cascade that would push a block out of the last tier (not a shared one,
  whose victims only leave this manager's view) while any tier has a free slot is declined
  the same way: the drop would be needed only because the run still holds its own slots
  (room is made before a run leaves them, with no staging buffer). A promotion never gets
  there: it moves a run longer than the free slots in pieces of as many blocks as there are
  free slots, each leaving the room the next one needs (``TierManager._promote``). With
  every tier full the victims leave, and the slots the run frees are the hole the next
  demotion fills.

Before a tier gives up a victim, this manager's moves in flight out of that tier complete
first (each frees a slot there, which may be all the room needed). A caller that may not
block (a prefetch) does not wait: it still demotes, but pushes nothing out of the last tier
while any move is in flight (one may be about to free the slot it needs) and is refused
instead. A replay has none in flight.

An id a ``keep_all`` access reads (``TierManager.access``) never leaves while it runs, as a
held one: the last tier never picks it as a victim (nor, in write-through, a tier holding its
only copy) and the admission below never refuses it.

Invariant: a victim leaves the hierarchy only as a victim of the last tier, when refused
by the admission of the tier that would take it, or (unguarded placements only) when no
tier below can make room for it. Inserts come in chunks no larger than the smallest tier
on their way down (``TierManager._insert_chunks``), so the victims of one chunk never
outnumber the slots of a tier below. A chunk (or a prefetch's run) refused because room can
be made for fewer blocks than it has (some pinned, referenced or held; a run longer than a
tier) is placed in pieces of what fits instead (``_place_in_pieces``): only what room cannot
be made for is refused, counted.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from .guards import _NOTHING, Either, Guard, HeldWithoutCopy
from .plans import Ev, Room

__all__ = ["RoomMixin"]

# Module constants: an enum member looked up on its class costs a descriptor call, and
# _make_room runs once per insert in a replay.
_MADE, _NO_VICTIMS, _WRITE_FAILED = Room.MADE, Room.NO_VICTIMS, Room.WRITE_FAILED


class RoomMixin:
    """``make_room`` and the demotion cascade of ``TierManager`` (see the module docstring).

    Relies on the manager's ``dirs``, ``policies``, ``_victims``, ``_admit`` and ``_hooks`` (each
    tier's ``victims``, ``admit`` and eviction hooks, checked or handed copies for an
    out-of-tree policy: ``tiercache.core.answers``),
    ``engine``, ``events``, ``refs``, ``held``, ``write_through``, ``shared``, ``inflight``,
    ``_running``, ``_may_block``, ``_pass_full``, ``_kept``, ``_future`` and ``_departed``, and on ``_transfer``, ``wait``,
    ``_leave_for_shared`` and ``_report_departed`` (``TransferMixin``).
    """

    @contextmanager
    def passing_full_tiers(self) -> Iterator[None]:
        """Within it, the victims of a guarded placement (a promotion, a prefetch) pass a tier
        below that cannot give up room (it holds the run itself, or pinned or referenced
        blocks) to the nearest tier further down that can take them, instead of the whole
        placement being declined (see the module docstring). Nests; restores the default on exit."""
        before = self._pass_full
        self._pass_full = True
        try:
            yield
        finally:
            self._pass_full = before

    def make_room(self, tier: int, n: int, protected=frozenset()) -> bool:
        """Ensures ``n`` free slots in ``tier`` by displacing victims; False when it cannot.

        Victims of an exclusive tier are demoted (cascading down); victims of the last tier,
        or of any tier in write-through mode, leave that tier. False with no victims (or,
        with ``protected`` ids, no room below for them) displaces nothing (moves in flight out
        of ``tier``, which it waits for to use the slots they free, may have landed), except
        past held victims, where room is made a slot at a time (``_room_past_held``) and the
        slots made before the one that failed stay made (their blocks moved down, or out of
        the hierarchy from a full last tier); False because
        a write-back failed leaves every victim where it was (victims refused by the
        admission below have left, as they would have anyway).
        """
        return self._make_room(tier, n, protected) is _MADE

    def _make_room(self, tier: int, n: int, protected) -> Room:
        directory = self.dirs[tier]
        need = n - directory.n_free
        if need <= 0:
            return _MADE
        if need > directory.capacity:
            return _NO_VICTIMS
        last = self.write_through or tier + 1 == len(self.dirs)
        if self._running and self._wait_moves(tier, into=False):
            # A move out of the tier was about to free a slot: use it rather than displace a
            # block for it (in the last tier, never drop one for it).
            return self._make_room(tier, n, protected)  # count the freed slots again
        if self._running and not self._may_block and tier + 1 == len(self.dirs):
            # A prefetch (which may not wait) pushes nothing out of the hierarchy while moves
            # are in flight: one of them may be about to free the slot it needs. It goes without.
            return _NO_VICTIMS
        victims = self._victims[tier](need, self._victim_guard(tier, protected, last))
        if victims is None:
            return _NO_VICTIMS
        if last:
            return self._let_go(tier, victims, protected)
        room = self._demote(tier, victims, protected)
        if room is not _NO_VICTIMS or protected or not (self.held or self._kept):
            return room
        # Held victims found no room below (every tier below full of blocks that may not leave):
        # make the room a slot at a time, each from a victim that may leave if it must.
        return self._room_past_held(tier, n, protected) if need > 1 else self._demote_leavable(tier, protected)

    def _let_go(self, tier: int, victims: list[int], protected) -> Room:
        """Victims of the last tier, or of a write-through tier, leave it. In write-through,
        a victim whose copy down failed (``_uncopied``: a full or failing disk) and that no
        local tier below holds moves down first, as an exclusive tier's victim does
        (``_demote``), so it leaves the hierarchy only as the module's invariant allows; while
        that move is declined or its write fails no victim leaves (the caller's placement is
        refused). One that reaches the last local tier is forgotten. A victim whose copies
        the admission below refused, or for which no room was made below, leaves, as before.
        The rest, with a copy below, are dropped."""
        last_local = len(self.dirs) - 1 if self.shared is None else self.shared - 1
        if self._uncopied and tier < last_local:
            below = [d.slot_of for d in self.dirs[tier + 1 : last_local + 1]]
            orphans = [v for v in victims if v in self._uncopied and not any(v in slots for slots in below)]
            if orphans:
                room = self._demote(tier, orphans, protected)
                if room is not _MADE:
                    return room
                bottom = self.dirs[last_local].slot_of
                self._uncopied.difference_update(v for v in orphans if v in bottom)
                here = self.dirs[tier].slot_of
                victims = [v for v in victims if v in here]
        if victims:
            self._drop(tier, victims)
        return _MADE

    def _room_past_held(self, tier: int, n: int, protected) -> Room:
        """``_make_room(tier, n)`` one slot at a time, after the victims of an unguarded
        placement into exclusive ``tier`` were refused because held ones among them found no
        room below: each slot is made from the policy's victim, or, when that is held and cannot
        move down, from one that may leave (``_demote_leavable``). Stops at the first slot no
        room can be made for (its outcome: no victim, or a failed write-back); slots made before
        it stay made."""
        directory = self.dirs[tier]
        while directory.n_free < n:
            room = self._make_room(tier, directory.n_free + 1, protected)
            if room is not _MADE:
                return room
        return _MADE

    def _demote_leavable(self, tier: int, protected) -> Room:
        """One slot of exclusive ``tier`` made from a victim that may leave the hierarchy (not
        held, not read by a ``keep_all`` access: the last tier's guard), after the policy's own
        victim, held, found no room below: it is demoted as any victim, so with no tier below
        able to take it, it leaves, counted as an eviction of ``tier``. So a held victim never
        refuses an unguarded placement while a block that may leave (not pinned or referenced)
        sits in a tier on its way down (``tests/test_decode_probe_r14.py``).
        ``Room.NO_VICTIMS`` when every block of ``tier`` is held, kept, pinned or referenced."""
        victims = self._victims[tier](1, self._victim_guard(tier, protected, True))
        if victims is None:
            return _NO_VICTIMS
        return self._demote(tier, victims, protected)

    def _victim_guard(self, tier: int, protected, last: bool):
        """Ids of ``tier`` that may not be its victims: pinned there by a move, referenced,
        ``protected`` and, where they would leave the hierarchy (``last``: the last tier, any
        tier in write-through), held or read by a ``keep_all`` access (they may move down,
        never out). The common case has nothing protected: a plain empty set keeps the
        policy's membership test in C instead of a Python ``__contains__`` per candidate."""
        directory = self.dirs[tier]
        held = self._held_guard(tier) if last and (self.held or self._kept) else _NOTHING
        if directory.pins or self.refs or protected or held:
            return Guard(directory.pins, self.refs, protected, held)
        return _NOTHING

    def _room_possible(self, tier: int, protected) -> int:
        """Most slots room can be made for in ``tier`` now: its free slots plus those of its
        blocks that may be victims (``_victim_guard``), the largest ``n`` for which its policy
        can name the victims ``_make_room(tier, n, protected)`` needs. Slots reserved by moves
        in flight into it count neither way. Walks the guard's ids, not the tier's."""
        directory = self.dirs[tier]
        last = self.write_through or tier + 1 == len(self.dirs)
        guard = self._victim_guard(tier, protected, last)
        resident = directory.slot_of
        kept = sum(1 for block_id in guard if block_id in resident) if guard else 0
        return directory.n_free + len(resident) - kept

    def _place_in_pieces(self, bounds: list[tuple[int, int]], place: Callable[[int, int], bool],
                         fit: Callable[[], int]) -> list[tuple[int, int]]:
        """Places the pieces ``[a, b)`` of ``bounds`` in order with ``place(a, b)`` (False: no
        room was made for it, nothing placed); returns the pieces refused, in order.

        A piece refused while ``fit()``, the most room can be made for now (``_room_possible``:
        some slots pinned, referenced or held, or a run longer than a tier), is smaller than
        it is cut into pieces of ``fit()`` and those placed instead, and so is every later
        piece larger than that; a piece refused though it fits (a failed write-back) is
        refused whole, as before.

        Invariants: the pieces cover ``bounds`` in order, none ever grows (a piece of one id
        stays one id: one-at-a-time inserts stay so), and each cut strictly shrinks the piece
        refused, so this ends. With every piece placed at its first try (a replay, where
        nothing is pinned) ``place`` is called exactly once per piece of ``bounds``.
        """
        refused: list[tuple[int, int]] = []
        pending = bounds[::-1]  # a stack: the next piece last
        while pending:
            a, b = pending.pop()
            if place(a, b):
                continue
            size = fit()
            if not 0 < size < b - a:
                refused.append((a, b))
                continue
            pending.append((a, b))
            pending = [cut for x, y in pending[::-1] for cut in _cut(x, y, size)][::-1]
        return refused

    def _held_guard(self, tier: int):
        """Blocks ``tier`` may not drop, held or read by a ``keep_all`` access: all in the last
        tier, else those without a lower copy."""
        staying = Either(self._kept, self.held) if self._kept else self.held
        if tier + 1 == len(self.dirs):
            return staying
        return HeldWithoutCopy(staying, [d.slot_of for d in self.dirs[tier + 1 :]])

    def _retry_room(self, tier: int, n: int, protected) -> bool:
        """After ``_make_room`` failed: waits for this manager's moves in flight into or out of
        ``tier`` (slots reserved or pinned) and tries once more. A replay has none in flight."""
        return bool(self._running) and self._wait_moves(tier, into=True) and self._make_room(tier, n, protected) is _MADE

    def _moves(self, tier: int, into: bool) -> list[int]:
        """This manager's moves in flight that free a slot of ``tier`` when they land (out of it,
        copies left out: they keep their source), or, with ``into``, any into or out of it
        (slots reserved or pinned), oldest first."""
        inflight = self.inflight
        return [j for j in sorted(self._running)
                if (inflight[j].src_tier == tier and (into or not inflight[j].keep_source)) or (into and inflight[j].dst_tier == tier)]

    def _wait_moves(self, tier: int, into: bool) -> bool:
        """Waits for ``_moves(tier, into)``; True when it waited for any. False, waiting for
        none, while the caller may not block (``_may_block`` False: a prefetch)."""
        moving = self._moves(tier, into) if self._may_block else []
        for job_id in moving:
            self.wait(job_id)
        return bool(moving)

    def _free_slots(self) -> int:
        """Free slots of the whole hierarchy. A guarded cascade of ``n`` blocks from the top
        tier (which skips no tier) pushes a block out of the last tier exactly when
        ``n`` exceeds them."""
        return sum(d.n_free for d in self.dirs)

    def _run_holds_the_room(self, tier: int, n: int, protected) -> bool:
        """Whether a guarded cascade must stop before ``tier``: it is the last tier, too
        full for ``n`` victims, while some tier has a free slot (see the module docstring).
        Not a shared tier: its victims only leave this manager's view of the store. Moves in
        flight out of ``tier`` complete first (a caller that may not block stops)."""
        if not protected or tier + 1 != len(self.dirs) or tier == self.shared or n <= self.dirs[tier].n_free:
            return False
        if self._running and self._moves(tier, into=False):
            if not self._wait_moves(tier, into=False):
                return True
            if n <= self.dirs[tier].n_free:
                return False
        return self._free_slots() > 0

    def _drop(self, tier: int, ids: Sequence[int]) -> None:
        self._hooks[tier].on_remove(ids)
        self.engine.discard(tier, ids, self.dirs[tier].remove(ids))
        self.events.emit(Ev.EVICT, tier, len(ids))
        if self.events.records_departures:
            self._report_departed(ids)
        if self._future is not None:
            self._departed.extend(ids)

    def _room_below(self, tier: int, n: int, protected) -> tuple[int, Room]:
        """Makes room for ``n`` victims of ``tier`` below it: ``(destination, outcome)``.

        Tries the tier right below (after waiting for its moves in flight when it is full of
        pinned blocks: ``_retry_room``), then, for an unguarded placement (empty
        ``protected``) or inside ``passing_full_tiers``, each tier further down. ``Room.NO_VICTIMS`` when none can take them,
        or when a guarded cascade would push a block out of the last tier while the hierarchy
        has a free slot (``_run_holds_the_room``).
        """
        last = len(self.dirs) if not protected or self._pass_full else tier + 2
        for dst in range(tier + 1, last):
            if self._run_holds_the_room(dst, n, protected):
                break
            room = self._make_room(dst, n, protected)
            if room is _NO_VICTIMS and self._retry_room(dst, n, protected):
                room = _MADE
            if room is not _NO_VICTIMS:
                return dst, room
        return tier + 1, _NO_VICTIMS

    def _demote(self, tier: int, victims: list[int], protected) -> Room:
        """Moves victims down (see the module docstring); refused ones leave the hierarchy.

        Returns ``Room.NO_VICTIMS`` (a guarded placement declined, or held victims with no
        room below: the placement above is refused) and ``Room.WRITE_FAILED`` when a
        write-back (this one, or one further down the cascade) failed (a full or failing
        disk): the victims then stay where they are, so no block is ever dropped to make
        room for a write that did not land, and the caller's placement is refused instead
        (victims whose bytes proved unusable are dropped as lost, and the rest moved:
        ``_move_down``)."""
        below = tier + 1
        held = self.held
        moving = self._admitted(tier, below, victims)
        if below == self.shared:
            moving = self._leave_for_shared(tier, moving)
        if not moving:
            return _MADE
        room_below = self.dirs[below].capacity
        if held and len(moving) > room_below and any(v in held for v in moving):
            # More held victims than the tier below holds: move them in pieces, each piece
            # pushing the previous one further down, instead of refusing the placement.
            pieces = [moving[a : a + room_below] for a in range(0, len(moving), room_below)]
        else:
            pieces = [moving]
        for piece in pieces:
            dst, room = self._room_below(tier, len(piece), protected)
            if room is _NO_VICTIMS:
                if protected or (held and any(v in held for v in piece)):
                    return _NO_VICTIMS  # declined: nothing leaves for a block the hierarchy holds
                self._drop(tier, piece)  # no tier below can take them: they leave
                continue
            if dst != below:
                piece = self._admitted_further(tier, dst, piece)
            if piece and (room is _WRITE_FAILED or not self._move_down(piece, tier, dst)):
                if dst != self.shared or (held and any(v in held for v in piece)):
                    return _WRITE_FAILED
                self._drop(tier, [v for v in piece if v in self.dirs[tier].slot_of])  # best effort: an eviction
        return _MADE

    def _move_down(self, piece: list[int], tier: int, dst: int) -> bool:
        """Moves victims ``piece`` of ``tier`` into ``dst`` (room made there) and waits; True
        once every one has left ``tier``. A move that failed because some of its blocks proved
        unusable (``JobResult.lost``: unreadable, or values ``dst``'s codec cannot store) has
        dropped those, counted; the rest, as movable as before, are moved once more, so a lost
        block never refuses the placement it was a victim for. Any other failure leaves every
        victim where it was (False)."""
        if self._transfer(piece, tier, dst, False, None):
            return True
        here = self.dirs[tier].slot_of
        rest = [v for v in piece if v in here]
        if len(rest) == len(piece):
            return False
        return not rest or self._transfer(rest, tier, dst, False, None)

    def _admitted(self, tier: int, dst: int, victims: list[int]) -> list[int]:
        """Victims of ``tier`` that ``dst``'s admission lets in, in order; the refused leave
        the hierarchy, counted. Held blocks and those a ``keep_all`` access reads are never
        refused: they may not leave."""
        admitted = self._admit[dst](victims)
        held, kept = self.held, self._kept
        refused = [v for v, ok in zip(victims, admitted) if not ok and v not in held and v not in kept]
        if not refused:
            return list(victims)
        self.events.emit(Ev.REFUSED, dst, len(refused))
        self._drop(tier, refused)
        gone = set(refused)
        return [v for v in victims if v not in gone]

    def _admitted_further(self, tier: int, dst: int, piece: list[int]) -> list[int]:
        """Victims of ``tier`` bound for ``dst`` past a full tier: those ``dst`` admits
        (``_admitted``) and, for a shared ``dst``, those it does not hold yet."""
        piece = self._admitted(tier, dst, piece)
        return self._leave_for_shared(tier, piece) if dst == self.shared else piece


def _cut(a: int, b: int, size: int) -> list[tuple[int, int]]:
    """``[a, b)`` cut into consecutive pieces of at most ``size`` ids, in order."""
    return [(x, min(x + size, b)) for x in range(a, b, size)]
