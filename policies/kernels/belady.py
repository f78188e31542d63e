"""Kernel of ``tiercache.policies.belady.Belady``: an indexed max-heap on next use.

Order: later next use first; equal next uses (only "never again") by the sequence number of
their last update, older first, as the class's lazy heap pops ``(-next_use, seq)``. Next uses
come from ``G[HINT]``, which the chain sets before each hook call to the values the class
gets as ``Hints.next_use`` (the access's own next use; a demoted block's last known one).
"""

from __future__ import annotations

from . import HINT, NIL, PROT, njit

CODE = 6
BATCH_INSERT_SAFE = False
FIELDS = 5
META = 2
HEAP, POS, KEY, SEQ, TAKEN = 0, 1, 2, 3, 4
SIZE, SEQC = 0, 1


@njit
def init(P, M, X, t, capacity):
    P[t, :, POS] = NIL
    M[t, SIZE] = 0
    M[t, SEQC] = 0


@njit
def _before(P, t, x, y):
    """True when ``x`` is evicted before ``y``."""
    kx = P[t, x, KEY]
    ky = P[t, y, KEY]
    return kx > ky or (kx == ky and P[t, x, SEQ] < P[t, y, SEQ])


@njit
def _place(P, t, i, x):
    P[t, i, HEAP] = x
    P[t, x, POS] = i


@njit
def _sift_up(P, t, i):
    x = P[t, i, HEAP]
    while i > 0:
        parent = (i - 1) >> 1
        y = P[t, parent, HEAP]
        if not _before(P, t, x, y):
            break
        _place(P, t, i, y)
        i = parent
    _place(P, t, i, x)


@njit
def _sift_down(P, M, t, i):
    n = M[t, SIZE]
    x = P[t, i, HEAP]
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and _before(P, t, P[t, child + 1, HEAP], P[t, child, HEAP]):
            child += 1
        y = P[t, child, HEAP]
        if not _before(P, t, y, x):
            break
        _place(P, t, i, y)
        i = child
    _place(P, t, i, x)


@njit
def _push(P, M, t, x):
    i = M[t, SIZE]
    M[t, SIZE] = i + 1
    _place(P, t, i, x)
    _sift_up(P, t, i)


@njit
def _remove(P, M, t, x):
    i = P[t, x, POS]
    last = M[t, SIZE] - 1
    M[t, SIZE] = last
    P[t, x, POS] = NIL
    if i != last:
        y = P[t, last, HEAP]
        _place(P, t, i, y)
        _sift_up(P, t, i)
        _sift_down(P, M, t, P[t, y, POS])


@njit
def _set(P, M, t, x, when):
    M[t, SEQC] += 1
    P[t, x, SEQ] = M[t, SEQC]
    P[t, x, KEY] = when
    if P[t, x, POS] == NIL:
        _push(P, M, t, x)
    else:
        i = P[t, x, POS]
        _sift_up(P, t, i)
        _sift_down(P, M, t, P[t, x, POS])


@njit
def on_insert(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        _set(P, M, t, arr[k], G[HINT, arr[k]])


@njit
def on_access(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        _set(P, M, t, arr[k], G[HINT, arr[k]])


@njit
def on_remove(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        _remove(P, M, t, arr[k])


@njit
def victims(P, M, X, G, t, n):
    """Pops in eviction order until ``n`` unprotected ids are found, then pushes all back
    (the order is total, so the heap orders them as before); one unprotected top is read
    without popping."""
    prot = G[PROT]
    out = P[t, :, P.shape[2] - 1]  # the victims column
    if n == 1 and M[t, SIZE] > 0 and prot[P[t, 0, HEAP]] == 0:
        out[0] = P[t, 0, HEAP]
        return True
    taken = 0
    found = 0
    while found < n and M[t, SIZE] > 0:
        x = P[t, 0, HEAP]
        _remove(P, M, t, x)
        P[t, taken, TAKEN] = x
        taken += 1
        if prot[x] == 0:
            out[found] = x
            found += 1
    for k in range(taken):
        _push(P, M, t, P[t, k, TAKEN])
    return found == n
