"""Kernel of ``tiercache.policies.lfu.LFU``: one list per hit count, lowest count evicted first.

Bucket ``f`` holds the ids with count ``f`` (1 on insert, +1 per hit), least recently moved
there first, exactly as ``PriorityPolicy``'s ordered buckets. Bucket heads and tails are rows
of ``P`` indexed by the count, so ``L`` must exceed the largest count (an id's accesses + 1).
"""

from __future__ import annotations

from . import NIL, PROT, njit

CODE = 2
BATCH_INSERT_SAFE = False
FIELDS = 5
META = 3
PREV, NXT, FREQ, BHEAD, BTAIL = 0, 1, 2, 3, 4
MINF, MAXF, SIZE = 0, 1, 2


@njit
def init(P, M, X, t, capacity):
    P[t, :, BHEAD] = NIL
    P[t, :, BTAIL] = NIL
    M[t, MINF] = 1
    M[t, MAXF] = 1
    M[t, SIZE] = 0


@njit
def _append(P, M, t, f, x):
    last = P[t, f, BTAIL]
    P[t, x, PREV] = last
    P[t, x, NXT] = NIL
    if last == NIL:
        P[t, f, BHEAD] = x
    else:
        P[t, last, NXT] = x
    P[t, f, BTAIL] = x
    P[t, x, FREQ] = f
    if f > M[t, MAXF]:
        M[t, MAXF] = f


@njit
def _leave(P, M, t, x):
    """Takes ``x`` out of its bucket; returns True when the bucket is now empty."""
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
    return P[t, f, BHEAD] == NIL


@njit
def on_insert(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        _append(P, M, t, 1, arr[k])
        M[t, SIZE] += 1
    if b > a:
        M[t, MINF] = 1


@njit
def on_access(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        x = arr[k]
        f = P[t, x, FREQ]
        if _leave(P, M, t, x) and M[t, MINF] == f:
            M[t, MINF] = f + 1
        _append(P, M, t, f + 1, x)


@njit
def on_remove(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        x = arr[k]
        f = P[t, x, FREQ]
        M[t, SIZE] -= 1
        if _leave(P, M, t, x) and M[t, MINF] == f:
            g = f
            while g <= M[t, MAXF] and P[t, g, BHEAD] == NIL:
                g += 1
            M[t, MINF] = g


@njit
def victims(P, M, X, G, t, n):
    """Lowest count first, least recently moved first within a count, skipping protected ids."""
    prot = G[PROT]
    out = P[t, :, P.shape[2] - 1]  # the victims row
    found = 0
    f = M[t, MINF]
    top = M[t, MAXF]
    while f <= top and found < n:
        x = P[t, f, BHEAD]
        while x != NIL and found < n:
            if prot[x] == 0:
                out[found] = x
                found += 1
            x = P[t, x, NXT]
        f += 1
    return found == n
