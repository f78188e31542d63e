"""A min-heap with one live entry per id and lazy invalidation (Belady, leaf_lru).

Re-keying an id pushes a new entry and leaves the old one in the heap as *stale*; stale
entries are dropped when they reach the top, and the heap is rebuilt from live entries when
stale ones outnumber live ones, so memory stays O(live) and every operation is O(log n)
amortized.
"""

from __future__ import annotations

import heapq
from typing import KeysView

#: One heap entry: (key, seq, id); seq is unique, so ties on key pop in push order.
Entry = tuple[int, int, int]


class LazyHeap:
    """Min-heap of ids by integer key.

    Invariant: ``_live[id]`` is the seq of id's only live entry; an entry whose seq differs
    from ``_live.get(id)`` is stale. ``_key[id]`` is the key of the live entry.
    """

    def __init__(self) -> None:
        self._heap: list[Entry] = []
        self._live: dict[int, int] = {}
        self._key: dict[int, int] = {}
        self._seq = 0

    def set(self, block_id: int, key: int) -> None:
        """Makes (key, id) the live entry of ``block_id``, replacing any previous one."""
        self._seq += 1
        self._live[block_id] = self._seq
        self._key[block_id] = key
        heapq.heappush(self._heap, (key, self._seq, block_id))
        self._maybe_compact()

    def discard(self, block_id: int) -> None:
        """Forgets ``block_id`` if present (its entry goes stale)."""
        if self._live.pop(block_id, None) is not None:
            del self._key[block_id]
            self._maybe_compact()

    def peek(self) -> Entry | None:
        """The smallest live entry, dropping stale entries above it; None if empty."""
        heap, live = self._heap, self._live
        while heap:
            entry = heap[0]
            if live.get(entry[2]) == entry[1]:
                return entry
            heapq.heappop(heap)
        return None

    def pop(self) -> Entry | None:
        """Removes and returns the smallest live entry; it stays live (see ``restore``)."""
        entry = self.peek()
        if entry is not None:
            heapq.heappop(self._heap)
        return entry

    def restore(self, entries: list[Entry]) -> None:
        """Pushes back entries taken with ``pop`` (no set/discard may happen in between)."""
        for entry in entries:
            heapq.heappush(self._heap, entry)

    @property
    def last_seq(self) -> int:
        """The seq of the latest ``set`` (the next one gets a larger one)."""
        return self._seq

    def rebuild(self, entries: dict[int, tuple[int, int]], next_seq: int) -> None:
        """Replaces every entry: ``entries`` maps each id to its (key, seq), seqs unique; later
        ``set`` calls number from ``next_seq + 1``, which must exceed every given seq."""
        self._heap = [(key, seq, block_id) for block_id, (key, seq) in entries.items()]
        heapq.heapify(self._heap)
        self._live = {block_id: seq for block_id, (_, seq) in entries.items()}
        self._key = {block_id: key for block_id, (key, _) in entries.items()}
        self._seq = next_seq

    def key(self, block_id: int) -> int:
        return self._key[block_id]

    def ids(self) -> KeysView[int]:
        """The ids with a live entry."""
        return self._key.keys()

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def _maybe_compact(self) -> None:
        # Stale entries with large keys may never surface; rebuild when they dominate.
        if len(self._heap) > 2 * len(self._live) + 64:
            live = self._live
            self._heap = [e for e in self._heap if live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def check_invariants(self) -> None:
        """Every live id has exactly one live entry in the heap, with its recorded key."""
        found = {}
        for key, seq, block_id in self._heap:
            if self._live.get(block_id) == seq:
                assert block_id not in found, f"two live entries for {block_id}"
                found[block_id] = key
        assert found == self._key, "live entries and recorded keys differ"
        assert self._live.keys() == self._key.keys()
