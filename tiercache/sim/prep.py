"""Per-access arrays a replay needs, computed once per trace: dense ids and next use.

``dense_and_next_use(ids)`` numbers the distinct ids ``0 .. n_ids - 1`` in order of first
access and gives each access the index of the next access to the same id
(``NO_NEXT_USE`` if none), in one compiled pass over a direct-address table when the ids
are small (Mooncake's are: ids < 4 x accesses) and one stable argsort otherwise. Both
paths give the same arrays (tested); the argsort is also the path without numba.

``step_next_use(next_use, is_write)`` turns a step trace's flat next uses into the ones an
offline policy reads there: a write supplies its id's block again, so the read before it is
the last use of the copy cached then (the replay refreshes a copy still cached at the write
to the write's next use: ``decode_replay``).
"""

from __future__ import annotations

import numpy as np

from tiercache.policies.base import NO_NEXT_USE
from tiercache.policies.kernels import HAVE_NUMBA, njit

__all__ = ["dense_and_next_use", "dense_and_next_use_sorted", "step_next_use"]

#: Largest id (relative to the number of accesses) the direct-address table is used for.
TABLE_FACTOR = 4


@njit
def _table_pass(ids, table, dense, next_use, never):
    """Dense ids in first-access order, then next uses from a backward scan."""
    n_ids = 0
    for i in range(len(ids)):
        x = ids[i]
        if table[x] < 0:
            table[x] = n_ids
            n_ids += 1
        dense[i] = table[x]
    last = table  # reused: next access of each dense id seen so far, scanning backward
    last[:n_ids] = never
    for i in range(len(ids) - 1, -1, -1):
        d = dense[i]
        next_use[i] = last[d]
        last[d] = i
    return n_ids


def dense_and_next_use(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(dense int32 ids, next use int64, number of distinct ids) of an int64 id array."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if not HAVE_NUMBA or len(ids) == 0 or int(ids.max()) >= TABLE_FACTOR * len(ids) + 1024:
        return dense_and_next_use_sorted(ids)
    table = np.full(int(ids.max()) + 1, -1, dtype=np.int64)
    dense = np.empty(len(ids), dtype=np.int32)
    next_use = np.empty(len(ids), dtype=np.int64)
    n_ids = _table_pass(ids, table, dense, next_use, NO_NEXT_USE)
    return dense, next_use, int(n_ids)


def dense_and_next_use_sorted(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The same arrays from one stable argsort (any ids, no numba)."""
    ids = np.asarray(ids, dtype=np.int64)
    next_use = np.full(len(ids), NO_NEXT_USE, dtype=np.int64)
    dense = np.zeros(len(ids), dtype=np.int32)
    if len(ids) == 0:
        return dense, next_use, 0
    order = np.argsort(ids, kind="stable")
    same = ids[order[1:]] == ids[order[:-1]]
    next_use[order[:-1][same]] = order[1:][same]
    group = np.concatenate(([0], np.cumsum(~same)))  # group of each sorted access, by id value
    first = order[np.concatenate(([True], ~same))]  # first access of each group
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))  # groups in first-access order
    dense[order] = rank[group]
    return dense, next_use, len(first)


def step_next_use(next_use: np.ndarray, is_write: np.ndarray) -> np.ndarray:
    """Next uses of a step trace's flat read + write stream, given its flat ``next_use``
    (the next access of each id, reads and writes alike) and ``is_write`` (aligned).

    A read is the only use of a block: an access's next use is the next *read* of its id
    before any later write of it, ``NO_NEXT_USE`` when a write of the id comes first or
    nothing follows. A write supplies the block again (stored anew if it was evicted), so
    keeping a copy for a read after the write is the write's business: a replay that finds
    the id still cached at the write stores nothing and sets its next use to the write's
    (``DecodeReplay._write``), as libCacheSim does with the write's oracleGeneral record.
    Every access gets one, writes included (when the block a write supplies is read next).
    Returns a new array; the inputs are unchanged.

    Invariants of the result ``nu``: ``nu[i]`` is ``next_use[i]`` or ``NO_NEXT_USE``;
    ``is_write[nu[i]]`` is False wherever ``nu[i] != NO_NEXT_USE``.
    """
    next_use = np.asarray(next_use, dtype=np.int64)
    is_write = np.asarray(is_write, dtype=bool)
    if next_use.shape != is_write.shape:
        raise ValueError(f"step_next_use: {len(next_use)} next uses, {len(is_write)} write flags")
    out = next_use.copy()
    follows = out != NO_NEXT_USE
    dead = np.zeros(len(out), dtype=bool)
    dead[follows] = is_write[out[follows]]
    out[dead] = NO_NEXT_USE
    return out
