"""S3-FIFO: a small probationary FIFO, a main FIFO with 2-bit reinsertion, and a ghost FIFO."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Collection, Sequence

from ._checks import enough_unprotected, require_new, require_tracked
from .base import EvictionPolicy, Hints

#: Hit counts saturate here (a 2-bit counter, as in the paper and libCacheSim).
MAX_FREQ = 3


@dataclass
class _Selection:
    """Scratch state of one ``victims`` call: ids popped from a queue head to put back."""

    protected: Collection[int]
    held_small: list[int] = field(default_factory=list)
    held_main: list[int] = field(default_factory=list)
    kept_main: int = 0  # protected ids among held_main: still part of main's size


class S3FIFO(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP'23) following libCacheSim's ``S3FIFO`` (v2 insertion rule).

    Parameters (libCacheSim's defaults): the small queue holds ``small_ratio`` = 10% of the
    capacity, main the rest, and the ghost queue remembers ``ghost_ratio`` = 90% of the
    capacity in ids (the size of main). A hit adds one to a block's count, capped at 3.

    * Insert: an id found in the ghost goes to main; otherwise to small, except that before
      the first eviction a full small queue sends new ids to main (libCacheSim's current
      ``S3FIFO.c``; the paper's original inserts to small). Counts start at 0.
    * Evict from main when main is over its share or small is empty, else from small.
    * Small's oldest block moves to main (count reset to 0) when its count is at least
      ``move_to_main_threshold``, else it is the victim and its id enters the ghost when
      removed. libCacheSim's default threshold is 2 (the paper's "accessed more than once");
      the issue's "freq >= 1" is available as ``S3FIFO(capacity, move_to_main_threshold=1)``
      but is not the default because it does not reproduce libCacheSim's miss ratios.
    * Main's oldest block with a count ``f >= 1`` is reinserted at main's back with ``f - 1``;
      a block with count 0 is the victim.

    Further differences from libCacheSim: the small queue holds at least one block (libCacheSim
    refuses every insert when 10% of the capacity is under 2 objects); protected ids stay at
    the head of their queue untouched; a victim stays at the head of its queue until
    ``on_remove``. ``victims`` first checks that ``n`` unprotected ids exist, because choosing
    promotes and decrements as the algorithm does.

    Invariants: ``_freq`` holds the tracked ids, each in exactly one of ``_small``/``_main``,
    with a count in [0, 3]; the ghost holds no tracked id and at most ``ghost_size`` ids after
    ``on_insert`` (one more between an ``on_remove`` and the next ``on_insert``).
    """

    name = "s3fifo"

    def __init__(
        self,
        capacity: int,
        small_ratio: float = 0.1,
        ghost_ratio: float = 0.9,
        move_to_main_threshold: int = 2,
    ) -> None:
        super().__init__(capacity)
        if not 0.0 < small_ratio < 1.0 or ghost_ratio < 0.0 or move_to_main_threshold < 1:
            raise ValueError("s3fifo: need 0 < small_ratio < 1, ghost_ratio >= 0, threshold >= 1")
        self.small_size = max(1, int(capacity * small_ratio))
        self.main_size = capacity - self.small_size
        self.ghost_size = int(capacity * ghost_ratio)
        self.move_to_main_threshold = move_to_main_threshold
        self._small: OrderedDict[int, None] = OrderedDict()  # oldest first, in every queue
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._freq: dict[int, int] = {}
        self._has_evicted = False

    def on_insert(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        require_new(self.name, ids, self._freq)
        for block_id in ids:
            self._freq[block_id] = 0
            if block_id in self._ghost:
                del self._ghost[block_id]
                self._main[block_id] = None
            elif not self._has_evicted and len(self._small) >= self.small_size:
                self._main[block_id] = None
            else:
                self._small[block_id] = None
        _trim(self._ghost, self.ghost_size)

    def on_access(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        freq = self._freq
        require_tracked(self.name, ids, freq)
        for block_id in ids:
            if freq[block_id] < MAX_FREQ:
                freq[block_id] += 1

    def on_remove(self, ids: Sequence[int]) -> None:
        require_tracked(self.name, ids, self._freq, distinct=True)
        for block_id in ids:
            del self._freq[block_id]
            if block_id in self._small:
                del self._small[block_id]
                self._remember(block_id)
            else:
                del self._main[block_id]

    def victims(self, n: int, protected: Collection[int] = ()) -> list[int] | None:
        if n <= 0:
            return []
        if not enough_unprotected(self._freq, protected, n):
            return None  # checked first: choosing promotes and decrements
        self._has_evicted = True
        sel = _Selection(protected)
        chosen = [self._pick(sel) for _ in range(n)]
        _put_back(self._small, sel.held_small)
        _put_back(self._main, sel.held_main)
        return chosen

    def in_main(self, block_id: int) -> bool:
        """Whether a tracked block sits in the main queue (False: the small one)."""
        if block_id not in self._freq:
            raise KeyError(f"{self.name}: block {block_id} is not tracked")
        return block_id in self._main

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._freq

    def _pick(self, sel: _Selection) -> int:
        """One eviction step; an unprotected id is known to exist."""
        if len(self._main) + sel.kept_main > self.main_size or not self._small:
            steps = (self._evict_main, self._evict_small, self._evict_main)
        else:
            steps = (self._evict_small, self._evict_main)  # small's promotions land in main
        for step in steps:
            block_id = step(sel)
            if block_id is not None:
                return block_id
        raise AssertionError("s3fifo: no victim although unprotected ids were counted")

    def _evict_small(self, sel: _Selection) -> int | None:
        """Promotes small's frequently hit heads to main until one can be evicted."""
        small, freq = self._small, self._freq
        while small:
            block_id = small.popitem(last=False)[0]
            if block_id in sel.protected:
                sel.held_small.append(block_id)
            elif freq[block_id] >= self.move_to_main_threshold:
                self._main[block_id] = None
                freq[block_id] = 0
            else:
                sel.held_small.append(block_id)
                return block_id
        return None

    def _evict_main(self, sel: _Selection) -> int | None:
        """Reinserts main's hit heads with one count less until a zero-count head is found."""
        main, freq = self._main, self._freq
        while main:
            block_id = main.popitem(last=False)[0]
            if block_id in sel.protected:
                sel.held_main.append(block_id)
                sel.kept_main += 1
            elif freq[block_id] >= 1:
                main[block_id] = None
                freq[block_id] -= 1
            else:
                sel.held_main.append(block_id)
                return block_id
        return None

    def _remember(self, block_id: int) -> None:
        """Records an id evicted from small in the ghost FIFO, dropping the oldest when full.

        The ghost may hold one id over its size until the next ``on_insert``: libCacheSim
        takes the incoming id out of the ghost *before* evicting for it, so the victim's entry
        must not push the oldest ghost out when the incoming id's entry is about to leave.
        """
        if self.ghost_size <= 0:
            return
        self._ghost[block_id] = None
        _trim(self._ghost, self.ghost_size + 1)

    def check_invariants(self) -> None:
        assert not (self._small.keys() & self._main.keys()), "block in both small and main"
        assert self._small.keys() | self._main.keys() == self._freq.keys(), "queues != tracked"
        assert not (self._ghost.keys() & self._freq.keys()), "tracked block in the ghost"
        assert len(self._ghost) <= self.ghost_size + (self.ghost_size > 0), "ghost over its size"
        assert all(0 <= f <= MAX_FREQ for f in self._freq.values()), "count out of range"


def _put_back(queue: OrderedDict[int, None], held: list[int]) -> None:
    """Returns ids popped from the head of ``queue`` to its head, in their original order."""
    for block_id in reversed(held):
        queue[block_id] = None
        queue.move_to_end(block_id, last=False)


def _trim(queue: OrderedDict[int, None], size: int) -> None:
    """Drops the oldest ids of ``queue`` until it holds at most ``size``."""
    while len(queue) > size:
        queue.popitem(last=False)
