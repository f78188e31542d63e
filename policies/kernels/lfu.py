"""Kernel of ``tiercache.policies.lfu.LFU``: one list per hit count, lowest count evicted first.

Bucket ``f`` holds the ids with count ``f`` (1 on insert, +1 per hit), least recently moved
there first, exactly as ``PriorityPolicy``'s ordered buckets. Bucket heads and tails are rows
of ``P`` indexed by the count, so ``L`` must exceed the largest count (an id's accesses + 1).

The non-empty counts form their own ascending linked list (``CPREV``/``CNEXT`` of the count's
row, head ``M[t, LOW]``), so every hook is O(1) per id and ``victims`` passes only non-empty
buckets: a hit moves an id from ``f`` to ``f + 1``, the one count that can follow ``f``, and an
insert goes to count 1, the lowest there is. Walking the range of counts instead was quadratic
when a few ids had huge counts (every removal of the last count-1 id scanned to the top).
"""

from __future__ import annotations

from . import NIL, PROT, njit

CODE = 2
BATCH_INSERT_SAFE = False
FIELDS = 7
META = 3
PREV, NXT, FREQ, BHEAD, BTAIL, CPREV, CNEXT = 0, 1, 2, 3, 4, 5, 6
LOW, SIZE = 0, 2  # M: the lowest non-empty count (NIL: none), the ids held


@njit
def init(P, M, X, t, capacity):
    P[t, :, BHEAD] = NIL
    P[t, :, BTAIL] = NIL
    P[t, :, CPREV] = NIL
    P[t, :, CNEXT] = NIL
    M[t, LOW] = NIL
    M[t, SIZE] = 0


@njit
def _link_count(P, M, t, f, before):
    """Files the empty count ``f`` in the count list after ``before`` (NIL: at the head)."""
    after = M[t, LOW] if before == NIL else P[t, before, CNEXT]
    P[t, f, CPREV] = before
    P[t, f, CNEXT] = after
    if before == NIL:
        M[t, LOW] = f
    else:
        P[t, before, CNEXT] = f
    if after != NIL:
        P[t, after, CPREV] = f


@njit
def _unlink_count(P, M, t, f):
    """Takes the now empty count ``f`` out of the count list."""
    before = P[t, f, CPREV]
    after = P[t, f, CNEXT]
    if before == NIL:
        M[t, LOW] = after
    else:
        P[t, before, CNEXT] = after
    if after != NIL:
        P[t, after, CPREV] = before
    P[t, f, CPREV] = NIL
    P[t, f, CNEXT] = NIL


@njit
def _append(P, t, f, x):
    """Puts ``x`` at the back of bucket ``f`` (filed in the count list by the caller)."""
    last = P[t, f, BTAIL]
    P[t, x, PREV] = last
    P[t, x, NXT] = NIL
    if last == NIL:
        P[t, f, BHEAD] = x
    else:
        P[t, last, NXT] = x
    P[t, f, BTAIL] = x
    P[t, x, FREQ] = f


@njit
def _leave(P, M, t, x):
    """Takes ``x`` out of its bucket, and the bucket's count out of the list once empty."""
    f = P[t, x, FREQ]
    before = P[t, x, PREV]
    after = P[t, x, NXT]
    if before == NIL:
        P[t, f, BHEAD] = after
    else:
        P[t, before, NXT] = after
    if after == NIL:
        P[t, f, BTAIL] = before
    else:
        P[t, after, PREV] = before
    if P[t, f, BHEAD] == NIL:
        _unlink_count(P, M, t, f)


@njit
def on_insert(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        if P[t, 1, BHEAD] == NIL:
            _link_count(P, M, t, 1, NIL)  # 1 is the lowest count: the head
        _append(P, t, 1, arr[k])
        M[t, SIZE] += 1


@njit
def on_access(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        x = arr[k]
        f = P[t, x, FREQ]
        if P[t, f + 1, BHEAD] == NIL:
            _link_count(P, M, t, f + 1, f)  # f is still filed: x is in it
        _leave(P, M, t, x)
        _append(P, t, f + 1, x)


@njit
def on_remove(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        _leave(P, M, t, arr[k])
        M[t, SIZE] -= 1


@njit
def victims(P, M, X, G, t, n):
    """Lowest count first, least recently moved first within a count, skipping protected ids."""
    prot = G[PROT]
    out = P[t, :, P.shape[2] - 1]  # the victims row
    found = 0
    f = M[t, LOW]
    while f != NIL and found < n:
        x = P[t, f, BHEAD]
        while x != NIL and found < n:
            if prot[x] == 0:
                out[found] = x
                found += 1
            x = P[t, x, NXT]
        f = P[t, f, CNEXT]
    return found == n
