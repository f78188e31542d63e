"""Kernel of ``tiercache.policies.s3fifo.S3FIFO`` (default parameters).

Small, main and ghost FIFOs share one pair of link rows (``WHERE`` names the queue; the
ghost holds untracked ids). ``victims`` pops queue heads as the class does and puts the
held ids back at the head afterwards, using two scratch rows as the held lists.
"""

from __future__ import annotations

from . import NIL, PROT, njit
from ._lists import pop_front, push_back, push_front, unlink

CODE = 4
BATCH_INSERT_SAFE = False
FIELDS = 6
META = 18
PREV, NXT, WHERE, FREQ, HELD_SMALL, HELD_MAIN = 0, 1, 2, 3, 4, 5
SMALL, MAIN, GHOST = 1, 2, 3
HAS_EVICTED, SMALL_SIZE, MAIN_SIZE, GHOST_SIZE, THRESHOLD, TRACKED = 9, 10, 11, 12, 13, 14
# Scratch of one victims call: ids held from small, from main, protected ones among the latter.
N_HELD_SMALL, N_HELD_MAIN, N_KEPT_MAIN = 15, 16, 17
MAX_FREQ = 3
SMALL_RATIO, GHOST_RATIO, MOVE_TO_MAIN = 0.1, 0.9, 2  # the class's defaults


@njit
def _h(q):
    return 3 * (q - 1)


@njit
def _size(M, t, q):
    return M[t, _h(q) + 2]


@njit
def _push(P, M, t, q, x):
    h = _h(q)
    push_back(P, M, t, PREV, NXT, h, h + 1, h + 2, x)
    P[t, x, WHERE] = q


@njit
def _unlink(P, M, t, x):
    h = _h(P[t, x, WHERE])
    unlink(P, M, t, PREV, NXT, h, h + 1, h + 2, x)
    P[t, x, WHERE] = 0


@njit
def _pop_head(P, M, t, q):
    """Unlinks the head of queue ``q`` (its WHERE is kept: it may go back)."""
    h = _h(q)
    return pop_front(P, M, t, PREV, NXT, h, h + 1, h + 2)


@njit
def _trim_ghost(P, M, t, size):
    while _size(M, t, GHOST) > size:
        x = _pop_head(P, M, t, GHOST)
        P[t, x, WHERE] = 0


@njit
def init(P, M, X, t, capacity):
    P[t, :, WHERE] = 0
    for q in range(1, 4):
        h = _h(q)
        M[t, h] = NIL
        M[t, h + 1] = NIL
        M[t, h + 2] = 0
    small = max(1, int(capacity * SMALL_RATIO))
    M[t, SMALL_SIZE] = small
    M[t, MAIN_SIZE] = capacity - small
    M[t, GHOST_SIZE] = int(capacity * GHOST_RATIO)
    M[t, THRESHOLD] = MOVE_TO_MAIN
    M[t, HAS_EVICTED] = 0
    M[t, TRACKED] = 0


@njit
def on_insert(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        x = arr[k]
        P[t, x, FREQ] = 0
        M[t, TRACKED] += 1
        if P[t, x, WHERE] == GHOST:
            _unlink(P, M, t, x)
            _push(P, M, t, MAIN, x)
        elif M[t, HAS_EVICTED] == 0 and _size(M, t, SMALL) >= M[t, SMALL_SIZE]:
            _push(P, M, t, MAIN, x)
        else:
            _push(P, M, t, SMALL, x)
    _trim_ghost(P, M, t, M[t, GHOST_SIZE])


@njit
def on_access(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        x = arr[k]
        if P[t, x, FREQ] < MAX_FREQ:
            P[t, x, FREQ] += 1


@njit
def on_remove(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        x = arr[k]
        M[t, TRACKED] -= 1
        was_small = P[t, x, WHERE] == SMALL
        _unlink(P, M, t, x)
        if was_small and M[t, GHOST_SIZE] > 0:
            _push(P, M, t, GHOST, x)
            _trim_ghost(P, M, t, M[t, GHOST_SIZE] + 1)


@njit
def _enough_unprotected(P, M, t, n, prot):
    found = 0
    for q in (SMALL, MAIN):
        x = M[t, _h(q)]
        while x != NIL:
            if prot[x] == 0:
                found += 1
                if found >= n:
                    return True
            x = P[t, x, NXT]
    return found >= n


@njit
def _evict_small(P, M, t, prot):
    """Promotes small's hit heads to main until one can be evicted ."""
    while _size(M, t, SMALL) > 0:
        x = _pop_head(P, M, t, SMALL)
        if prot[x] != 0:
            P[t, M[t, N_HELD_SMALL], HELD_SMALL] = x
            M[t, N_HELD_SMALL] += 1
        elif P[t, x, FREQ] >= M[t, THRESHOLD]:
            _push(P, M, t, MAIN, x)
            P[t, x, FREQ] = 0
        else:
            P[t, M[t, N_HELD_SMALL], HELD_SMALL] = x
            M[t, N_HELD_SMALL] += 1
            return x
    return NIL


@njit
def _evict_main(P, M, t, prot):
    """Reinserts main's hit heads with one count less until a zero-count head is found."""
    while _size(M, t, MAIN) > 0:
        x = _pop_head(P, M, t, MAIN)
        if prot[x] != 0:
            P[t, M[t, N_HELD_MAIN], HELD_MAIN] = x
            M[t, N_HELD_MAIN] += 1
            M[t, N_KEPT_MAIN] += 1
        elif P[t, x, FREQ] >= 1:
            h = _h(MAIN)
            push_back(P, M, t, PREV, NXT, h, h + 1, h + 2, x)
            P[t, x, FREQ] -= 1
        else:
            P[t, M[t, N_HELD_MAIN], HELD_MAIN] = x
            M[t, N_HELD_MAIN] += 1
            return x
    return NIL


@njit
def _pick(P, M, t, prot):
    if _size(M, t, MAIN) + M[t, N_KEPT_MAIN] > M[t, MAIN_SIZE] or _size(M, t, SMALL) == 0:
        x = _evict_main(P, M, t, prot)
        if x == NIL:
            x = _evict_small(P, M, t, prot)
        if x == NIL:
            x = _evict_main(P, M, t, prot)
        return x
    x = _evict_small(P, M, t, prot)
    if x == NIL:
        x = _evict_main(P, M, t, prot)
    return x


@njit
def victims(P, M, X, G, t, n):
    prot = G[PROT]
    out = P[t, :, P.shape[2] - 1]  # the victims row
    if n <= 0:
        return True
    if not _enough_unprotected(P, M, t, n, prot):
        return False
    M[t, HAS_EVICTED] = 1
    M[t, N_HELD_SMALL] = 0
    M[t, N_HELD_MAIN] = 0
    M[t, N_KEPT_MAIN] = 0
    for k in range(n):
        out[k] = _pick(P, M, t, prot)
    hs, hm = _h(SMALL), _h(MAIN)
    for k in range(M[t, N_HELD_SMALL] - 1, -1, -1):
        push_front(P, M, t, PREV, NXT, hs, hs + 1, hs + 2, P[t, k, HELD_SMALL])
    for k in range(M[t, N_HELD_MAIN] - 1, -1, -1):
        push_front(P, M, t, PREV, NXT, hm, hm + 1, hm + 2, P[t, k, HELD_MAIN])
    return True
