"""Compiled LRU stack distances: one backward Fenwick-tree walk over the trace.

The accesses are walked from the last to the first. Before the step at position ``p``, the
*marked* positions are the ``j > p`` that are their id's first access after ``p``: one per
distinct id of ``(p, N)``. When ``q`` is the next access of ``p``'s id, the distinct ids
touched strictly between them are exactly the marked positions below ``q`` (all marked ones
lie after ``p``; the id of ``p`` itself is marked at ``q``, not below it), so::

    stack_distance(q) = 1 + #{marked j < q}

and the step then unmarks ``q`` and marks ``p`` (now its id's first access after ``p - 1``).
A first access is never anyone's ``q``: its distance stays 0.

Each step is one prefix count and two point updates of a Fenwick (binary indexed) tree over
the positions: O(N log N) compiled work. Memory: the next-access array (int32 while
``N < 2**31``) and the tree (the same width), plus the answer: int64 distances (8 B per
access) or a histogram (8 B per distinct id at most). The next-access array comes from a
table indexed by id when the ids span at most ``2 N`` values (the usual dense ``hash_ids``:
8 B per access at most while it lives), else from a hash set of the ids (6-12 B per access
while it lives; expected O(1) per access; ids that collide beyond a probe budget are
sorted instead, as without numba).

The kernels allocate nothing (the callers pass every array): the project's ``njit`` compiles
without numba's reference counting. Without numba (``HAVE_NUMBA`` False) they would run as
plain Python, far too slow for a trace: ``mrc`` then takes its numpy path instead.
"""

from __future__ import annotations

import numpy as np

from tiercache.policies.kernels import HAVE_NUMBA, njit

__all__ = ["next_positions", "sorted_next_positions", "walk_distances", "walk_counts"]

#: Ids spanning fewer values than this many per access get a direct table (4 B per value).
_TABLE_SPAN_PER_ACCESS = 2
#: Probes past the home slots the hash set may make per access (about 2 on average at its
#: fill of 2/3 at most) before ``next_positions`` gives up on it and sorts the ids instead.
_PROBES_PER_ACCESS = 16


def _index_dtype(n: int) -> type:
    """The narrowest signed integer that holds every position of ``n`` accesses and ``-1``."""
    return np.int32 if n < np.iinfo(np.int32).max else np.int64


@njit
def _next_by_table(ids, low, table, nxt):
    """``nxt[i]``: the next position of ``ids[i]``, -1 when none.

    Walking backwards, ``table`` (all -1 on entry, a slot per value ``low .. max(ids)``) holds
    in slot ``ids[i] - low`` the earliest position after ``i`` of that id.
    """
    for i in range(ids.size - 1, -1, -1):
        slot = ids[i] - low
        nxt[i] = table[slot]
        table[slot] = i


#: Fibonacci hashing: the top bits of ``id * 2**64 / golden ratio`` (mod ``2**64``) pick the slot.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit
def _next_by_hash(ids, table, shift, nxt, budget):
    """``nxt[i]`` as ``_next_by_table``, for ids spread too wide for a table per value.

    ``table`` (all -1, a power of two of slots, ``shift = 64 - log2(slots)``) is an open-
    addressing hash set of ids with linear probing: a slot holds the earliest position after
    ``i`` of its id, and the id itself is read back as ``ids[slot's position]``. Returns
    False, with ``nxt`` incomplete, once the probes past the home slots exceed ``budget``:
    ids built to collide would make the walk quadratic (the caller sorts instead).
    """
    mask = table.size - 1
    for i in range(ids.size - 1, -1, -1):
        key = ids[i]
        slot = np.int64((np.uint64(key) * _GOLDEN) >> shift)
        while table[slot] >= 0 and ids[table[slot]] != key:
            slot = (slot + 1) & mask
            budget -= 1
            if budget < 0:
                return False
        nxt[i] = table[slot]
        table[slot] = i
    return True


def next_positions(ids: np.ndarray) -> np.ndarray:
    """Position of each access's next access to the same id, -1 where none.

    Args:
        ids: int64 block ids in access order.

    Returns:
        int32 (int64 from ``2**31`` accesses) array of ``len(ids)``; ``nxt[i] > i`` or -1,
        ``ids[nxt[i]] == ids[i]``, and no access of that id lies strictly between.
    """
    n = ids.size
    nxt = np.empty(n, dtype=_index_dtype(n))
    if n == 0:
        return nxt
    if not HAVE_NUMBA:
        return _next_by_sort(ids, nxt)
    low, high = int(ids.min()), int(ids.max())
    if high - low < _TABLE_SPAN_PER_ACCESS * n:
        table = np.full(high - low + 1, -1, dtype=nxt.dtype)
        _next_by_table(ids, np.int64(low), table, nxt)
        return nxt
    bits = max(int(1.5 * n).bit_length(), 4)  # at least 1.5 slots per access: 2/3 full at most
    table = np.full(1 << bits, -1, dtype=nxt.dtype)
    with np.errstate(over="ignore"):  # the hash wraps on purpose (numpy warns when uncompiled)
        done = _next_by_hash(ids, table, np.uint64(64 - bits), nxt, np.int64(_PROBES_PER_ACCESS * n + 1024))
    del table
    return nxt if done else _next_by_sort(ids, nxt)


def sorted_next_positions(ids: np.ndarray) -> np.ndarray:
    """``next_positions`` of ids of any type numpy sorts (strings, floats), by one argsort."""
    return _next_by_sort(ids, np.empty(ids.size, dtype=_index_dtype(ids.size)))


def _next_by_sort(ids: np.ndarray, nxt: np.ndarray) -> np.ndarray:
    """``nxt`` filled as ``next_positions`` promises, from one stable argsort of the ids
    (O(n log n) whatever the ids: the path without numba, and for ids that collide)."""
    order = np.argsort(ids, kind="stable")
    same = ids[order[1:]] == ids[order[:-1]]
    nxt.fill(-1)
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


@njit
def _walk(nxt, tree, out, counts, touched):
    """The backward walk of the module docstring over ``nxt`` (next positions: a value
    outside ``(p, N)`` means none, so both -1 and ``NO_NEXT_USE`` work).

    ``tree`` (zeros, ``N + 1``) is the Fenwick tree of the marks, 1-based: node ``k`` sums
    the marks of positions ``k - (k & -k) .. k - 1``. When ``out`` is not empty it gets
    every re-access's distance (its other entries are left as they are); when ``counts``
    is not empty, ``counts[d]`` grows by each re-access ``q`` of distance ``d`` for which
    ``touched[q]`` (every one when ``touched`` is empty). Returns False, the walk cut short,
    at a distance outside ``counts``: ``nxt`` is no next-access array (two accesses name
    the same next one, say), and the kernel writes nothing outside its arrays.
    """
    n = nxt.size
    for p in range(n - 1, -1, -1):
        q = nxt[p]
        if q <= p or q >= n:  # the last access of its id: mark p
            k = p + 1
            while k <= n:
                tree[k] += 1
                k += k & -k
            continue
        marked = 0
        k = q
        while k > 0:  # marks at positions 0 .. q - 1 (all of them after p)
            marked += tree[k]
            k -= k & -k
        if out.size:
            out[q] = marked + 1
        if counts.size and (touched.size == 0 or touched[q]):
            if marked + 1 >= counts.size or marked < 0:
                return False
            counts[marked + 1] += 1
        a, b = p + 1, q + 1  # mark p, unmark q: the two paths merge, and cancel, at a common node
        while a != b and min(a, b) <= n:
            if a < b:
                tree[a] += 1
                a += a & -a
            else:
                tree[b] -= 1
                b += b & -b
    return True


@njit
def _reaccesses(nxt):
    """How many accesses are some access's next one (``_walk``'s test of ``q``)."""
    n = nxt.size
    found = 0
    for p in range(n):
        if p < nxt[p] < n:
            found += 1
    return found


def _tree(n: int) -> np.ndarray:
    """A zeroed Fenwick tree for ``n`` positions (node 0 unused)."""
    return np.zeros(n + 1, dtype=_index_dtype(n + 1))


_NONE = np.zeros(0, dtype=np.int64)
_ALL = np.zeros(0, dtype=np.bool_)


def walk_distances(nxt: np.ndarray) -> np.ndarray:
    """LRU stack distance of every access (int64; 0 for a first access), from ``nxt`` as
    ``next_positions`` (or ``traces.next_use``) gives it."""
    out = np.zeros(nxt.size, dtype=np.int64)
    _walk(nxt, _tree(nxt.size), out, _NONE, _ALL)
    return out


def walk_counts(nxt: np.ndarray, touched: np.ndarray | None = None) -> np.ndarray:
    """Histogram of the stack distances of the accesses where ``touched`` (all when None).

    Equals ``np.bincount(walk_distances(nxt)[touched], minlength=1)`` (int64; ``counts[0]``
    counts first accesses; the last entry is nonzero unless the histogram is ``[0]``)
    without a per-access int64 array: a distance is at most the number of distinct ids.
    """
    n = nxt.size
    touched = _ALL if touched is None else np.asarray(touched, dtype=np.bool_)
    if touched is not _ALL and touched.shape != nxt.shape:  # the kernel reads touched[q] unchecked
        raise ValueError(f"touched has shape {touched.shape}, the trace {nxt.shape}")
    counts = np.zeros(n - _reaccesses(nxt) + 1, dtype=np.int64)  # distinct ids + 1
    if not _walk(nxt, _tree(n), _NONE, counts, touched):
        raise ValueError("walk_counts: nxt is not the next accesses of a trace (an access named as the next "
                         "of two, or a distance past the distinct ids)")
    counts[0] = (n if touched.size == 0 else int(np.count_nonzero(touched))) - int(counts.sum())
    used = np.flatnonzero(counts)
    return counts[: int(used[-1]) + 1 if used.size else 1].copy()
