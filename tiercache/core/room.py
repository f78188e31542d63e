"""Making room in a tier: the demotion cascade of ``TierManager`` (split out to keep modules small).

A tier that must free slots asks its eviction policy for victims. Victims of an exclusive
tier move down; victims of the last tier (of every tier in write-through mode) leave the
hierarchy. Where the victims go:

- to the tier right below, whose own victims cascade further down first;
- when that tier cannot give up enough victims (its blocks are pinned, referenced or held,
  or the victims outnumber its slots) and the placement guards nothing, to the nearest
  tier further down that can take them; they leave the hierarchy only when no tier below
  can take them;
- when the placement guards blocks (``protected``: a promotion or a prefetch, whose run
  may be exactly what fills the tier below), the whole placement is declined instead
  (``Room.NO_VICTIMS``, no block has moved): the caller reads the run where it lies. A
  block is never pushed out of the hierarchy to make room for one it already holds while
  a tier below still has room.

Invariant: a victim leaves the hierarchy only as a victim of the last tier, when refused
by the admission of the tier that would take it, or (unguarded placements only) when no
tier below can make room for it.
"""

from __future__ import annotations

from typing import Sequence

from .guards import _NOTHING, Guard, HeldWithoutCopy
from .plans import Ev, Room

__all__ = ["RoomMixin"]

# Module constants: an enum member looked up on its class costs a descriptor call, and
# _make_room runs once per insert in a replay.
_MADE, _NO_VICTIMS, _WRITE_FAILED = Room.MADE, Room.NO_VICTIMS, Room.WRITE_FAILED


class RoomMixin:
    """``make_room`` and the demotion cascade of ``TierManager`` (see the module docstring).

    Relies on the manager's ``dirs``, ``policies``, ``admissions``, ``engine``, ``events``,
    ``refs``, ``held``, ``write_through``, ``shared``, ``inflight``, ``_running``, ``_future``
    and ``_departed``, and on ``_transfer``, ``wait``, ``_leave_for_shared`` and
    ``_report_departed`` (``TransferMixin``).
    """

    def make_room(self, tier: int, n: int, protected=frozenset()) -> bool:
        """Ensures ``n`` free slots in ``tier`` by displacing victims; False when it cannot.

        Victims of an exclusive tier are demoted (cascading down); victims of the last tier,
        or of any tier in write-through mode, leave that tier. False with no victims (or,
        with ``protected`` ids, no room below for them) changes no residency; False because
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
        # The common case has nothing protected: a plain empty set keeps the policy's
        # membership test in C instead of a Python __contains__ per candidate.
        last = self.write_through or tier + 1 == len(self.dirs)
        held = self._held_guard(tier) if last and self.held else _NOTHING  # a held block may move down, never out
        guard = Guard(directory.pins, self.refs, protected, held) if (directory.pins or self.refs or protected or held) else _NOTHING
        victims = self.policies[tier].victims(need, guard)
        if victims is None:
            return _NO_VICTIMS
        if last:
            self._drop(tier, victims)
            return _MADE
        return self._demote(tier, victims, protected)

    def _held_guard(self, tier: int):
        """Held blocks ``tier`` may not drop: all in the last tier, else those without a lower copy."""
        if tier + 1 == len(self.dirs):
            return self.held
        return HeldWithoutCopy(self.held, [d.slot_of for d in self.dirs[tier + 1 :]])

    def _retry_room(self, tier: int, n: int, protected) -> bool:
        """After ``_make_room`` failed: waits for this manager's moves in flight into or out of
        ``tier`` (slots reserved or pinned) and tries once more. A replay has none in flight."""
        if not self._running:
            return False
        moving = [j for j in sorted(self._running) if tier in (self.inflight[j].src_tier, self.inflight[j].dst_tier)]
        for job_id in moving:
            self.wait(job_id)
        return bool(moving) and self._make_room(tier, n, protected) is _MADE

    def _drop(self, tier: int, ids: Sequence[int]) -> None:
        self.policies[tier].on_remove(ids)
        self.engine.discard(tier, ids, self.dirs[tier].remove(ids))
        self.events.emit(Ev.EVICT, tier, len(ids))
        if self.events.records_departures:
            self._report_departed(ids)
        if self._future is not None:
            self._departed.extend(ids)

    def _room_below(self, tier: int, n: int, protected) -> tuple[int, Room]:
        """Makes room for ``n`` victims of ``tier`` below it: ``(destination, outcome)``.

        Tries the tier right below (after waiting for its moves in flight when it is full of
        pinned blocks: ``_retry_room``), then, for an unguarded placement only (empty
        ``protected``), each tier further down. ``Room.NO_VICTIMS`` when none can take them.
        """
        last = len(self.dirs) if not protected else tier + 2
        for dst in range(tier + 1, last):
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
        room for a write that did not land, and the caller's placement is refused instead."""
        below = tier + 1
        admitted = self.admissions[below].admit(victims)
        held = self.held
        moving = [v for v, ok in zip(victims, admitted) if ok or v in held]
        refused = [v for v, ok in zip(victims, admitted) if not ok and v not in held]
        if refused:
            self.events.emit(Ev.REFUSED, below, len(refused))
            self._drop(tier, refused)
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
            if piece and (room is _WRITE_FAILED or not self._transfer(piece, tier, dst, False, None)):
                if dst != self.shared or (held and any(v in held for v in piece)):
                    return _WRITE_FAILED
                self._drop(tier, [v for v in piece if v in self.dirs[tier].slot_of])  # best effort: an eviction
        return _MADE

    def _admitted_further(self, tier: int, dst: int, piece: list[int]) -> list[int]:
        """Victims of ``tier`` bound for ``dst`` past a full tier: those ``dst`` admits (the
        refused leave, counted) and, for a shared ``dst``, those it does not hold yet."""
        admitted = self.admissions[dst].admit(piece)
        refused = [v for v, ok in zip(piece, admitted) if not ok and v not in self.held]
        if refused:
            self.events.emit(Ev.REFUSED, dst, len(refused))
            self._drop(tier, refused)
            gone = set(refused)
            piece = [v for v in piece if v not in gone]
        return self._leave_for_shared(tier, piece) if dst == self.shared else piece
