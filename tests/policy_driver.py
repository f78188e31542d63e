"""A tiny single-tier object-cache driver for policy tests (not the tiercache manager).

Each id is an object of size 1. For every access in order: a tracked id is a hit
(``on_access``); otherwise it is a miss, and when the cache is full the driver asks for one
victim and removes it *before* inserting the new id, which is the order libCacheSim uses
(evict, then insert). Offline policies get ``Hints.next_use`` and prefix-aware ones get
``Hints.parents`` on every call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tiercache.policies import NO_NEXT_USE, EvictionPolicy, Hints


@dataclass(frozen=True)
class ObjectTrace:
    """A flat access stream: ``ids[t]`` is accessed at time t; ``parents[t]`` its prefix parent."""

    ids: list[int]
    parents: list[int | None]
    next_use: list[int]


def load_jsonl(path: str | Path) -> ObjectTrace:
    """Reads a Mooncake-style JSONL trace: all ``hash_ids`` in file order, one access each.

    Within a request, ``hash_ids[i - 1]`` is the prefix parent of ``hash_ids[i]``; the first
    block of a request is a root.
    """
    ids: list[int] = []
    parents: list[int | None] = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            hash_ids = json.loads(line)["hash_ids"]
            ids.extend(hash_ids)
            parents.extend([None, *hash_ids[:-1]] if hash_ids else [])
    return ObjectTrace(ids, parents, next_uses(ids))


def from_ids(ids: Sequence[int], parents: Sequence[int | None] | None = None) -> ObjectTrace:
    """Builds a trace from a plain id list (parents default to roots)."""
    ids = list(ids)
    return ObjectTrace(ids, list(parents) if parents is not None else [None] * len(ids), next_uses(ids))


def next_uses(ids: Sequence[int]) -> list[int]:
    """``next_use[t]``: the next time ``ids[t]`` is accessed after t, or ``NO_NEXT_USE``."""
    out = [NO_NEXT_USE] * len(ids)
    last: dict[int, int] = {}
    for t in range(len(ids) - 1, -1, -1):
        block_id = ids[t]
        out[t] = last.get(block_id, NO_NEXT_USE)
        last[block_id] = t
    return out


def run(policy: EvictionPolicy, trace: ObjectTrace, check_every: int = 0) -> list[int | None]:
    """Replays ``trace`` through ``policy`` at its capacity; returns the victim of each access.

    ``result[t]`` is the id evicted to make room at time t, or None (a hit, or a miss with
    free space). With ``check_every`` > 0, ``check_invariants`` runs every that many accesses.
    """
    capacity = policy.capacity
    evicted: list[int | None] = [None] * len(trace.ids)
    for t, block_id in enumerate(trace.ids):
        hints = Hints(time=t, next_use=(trace.next_use[t],), parents=(trace.parents[t],))
        if block_id in policy:
            policy.on_access((block_id,), hints)
        else:
            if len(policy) >= capacity:
                victims = policy.victims(1)
                assert victims is not None and len(victims) == 1, f"no victim at t={t}"
                policy.on_remove(victims)
                evicted[t] = victims[0]
            policy.on_insert((block_id,), hints)
        if check_every and t % check_every == 0:
            policy.check_invariants()
    return evicted


def miss_ratio(policy: EvictionPolicy, trace: ObjectTrace) -> float:
    """Fraction of accesses that miss when ``trace`` is replayed through ``policy``."""
    misses = 0
    capacity = policy.capacity
    ids, next_use, parents = trace.ids, trace.next_use, trace.parents
    for t, block_id in enumerate(ids):
        hints = Hints(time=t, next_use=(next_use[t],), parents=(parents[t],))
        if block_id in policy:
            policy.on_access((block_id,), hints)
            continue
        misses += 1
        if len(policy) >= capacity:
            victims = policy.victims(1)
            assert victims is not None, f"{policy.name}: no victim at t={t}"
            policy.on_remove(victims)
        policy.on_insert((block_id,), hints)
    return misses / len(ids) if ids else 0.0
