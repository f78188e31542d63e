"""Shared driver for eviction policies that are one priority rule (LRU, FIFO, LFU).

A policy built on :class:`PriorityPolicy` only says where a block goes after a hit
(:meth:`PriorityPolicy.priority_after_hit`); the driver keeps the blocks in ordered buckets
and does the bookkeeping, validation and victim walk once for all of them.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict
from itertools import islice
from typing import ClassVar, Collection, Sequence

from ._checks import require_new, require_tracked
from .base import EvictionPolicy, Hints


class PriorityPolicy(EvictionPolicy):
    """Ids in buckets keyed by an integer priority; lowest priority, then oldest entry, goes first.

    Every tracked id sits in exactly one bucket. A new id enters bucket ``initial_priority``
    at the back; after a hit it moves to the back of bucket ``priority_after_hit(p)``, or stays
    where it is when that returns None. Victims are read in ascending priority and, within a
    bucket, oldest entry first; the walk stops as soon as ``n`` ids are found, so its cost is
    proportional to the ids it passes, never to the size of the cache.

    Invariants: ``_priority`` maps each tracked id to its bucket; ``_buckets[k]`` holds exactly
    the ids of priority ``k``, oldest entry first; ``_keys`` is the sorted list of non-empty
    bucket keys.
    """

    initial_priority: ClassVar[int] = 0

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._priority: dict[int, int] = {}
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._keys: list[int] = []

    def priority_after_hit(self, priority: int) -> int | None:
        """Bucket of a block after a hit in bucket ``priority``; None leaves it in place.

        Returning ``priority`` itself moves the block to the back of its bucket (LRU).
        """
        raise NotImplementedError

    def on_insert(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        require_new(self.name, ids, self._priority)
        start = self.initial_priority
        bucket = self._bucket(start)
        priority = self._priority
        for block_id in ids:
            priority[block_id] = start
            bucket[block_id] = None

    def on_access(self, ids: Sequence[int], hints: Hints | None = None) -> None:
        priority, buckets = self._priority, self._buckets
        require_tracked(self.name, ids, priority)
        after_hit = self.priority_after_hit
        for block_id in ids:
            old = priority[block_id]
            new = after_hit(old)
            if new == old:
                buckets[old].move_to_end(block_id)
            elif new is not None:
                self._leave(block_id, old)
                priority[block_id] = new
                self._bucket(new)[block_id] = None

    def on_remove(self, ids: Sequence[int]) -> None:
        priority, buckets = self._priority, self._buckets
        require_tracked(self.name, ids, priority, distinct=True)
        for block_id in ids:
            key = priority.pop(block_id)
            bucket = buckets[key]
            del bucket[block_id]
            if not bucket:
                self._drop_bucket(key)

    def victims(self, n: int, protected: Collection[int] = ()) -> list[int] | None:
        if n <= 0:
            return []
        if not protected and self._keys and len(self._buckets[self._keys[0]]) >= n:
            # Nothing protected and the lowest bucket suffices: take its n oldest in C.
            return list(islice(self._buckets[self._keys[0]], n))
        chosen: list[int] = []
        for key in self._keys:
            for block_id in self._buckets[key]:
                if block_id not in protected:
                    chosen.append(block_id)
                    if len(chosen) == n:
                        return chosen
        return None

    def __len__(self) -> int:
        return len(self._priority)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._priority

    def _bucket(self, key: int) -> OrderedDict[int, None]:
        """The bucket for ``key``, created (and its key filed in order) when missing."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = OrderedDict()
            insort(self._keys, key)
        return bucket

    def _leave(self, block_id: int, key: int) -> None:
        """Takes ``block_id`` out of bucket ``key``, dropping the bucket once empty."""
        bucket = self._buckets[key]
        del bucket[block_id]
        if not bucket:
            self._drop_bucket(key)

    def _drop_bucket(self, key: int) -> None:
        del self._buckets[key]
        del self._keys[bisect_left(self._keys, key)]

    def check_invariants(self) -> None:
        assert self._keys == sorted(self._buckets), "bucket keys out of order"
        seen = 0
        for key, bucket in self._buckets.items():
            assert bucket, f"empty bucket {key} kept"
            for block_id in bucket:
                assert self._priority.get(block_id) == key, f"block {block_id} filed in wrong bucket"
            seen += len(bucket)
        assert seen == len(self._priority), "a tracked block is in no bucket"
