"""Kernel of ``tiercache.policies.arc.ARC``: T1, T2 and their ghosts B1, B2, target ``p``.

The four lists share one pair of link rows (an id is in at most one); ``WHERE`` names it.
Float arithmetic on ``p`` is the Python class's, operation for operation.
"""

from __future__ import annotations

from . import NIL, PROT, njit
from ._lists import move_to_back, pop_front, push_back, unlink

CODE = 3
BATCH_INSERT_SAFE = False
FIELDS = 3
META = 13
PREV, NXT, WHERE = 0, 1, 2
T1, T2, B1, B2 = 1, 2, 3, 4
CAP = 12
P_TARGET = 0  # slot of X


@njit
def _h(lst):
    return 3 * (lst - 1)


@njit
def _push(P, M, t, lst, x):
    h = _h(lst)
    push_back(P, M, t, PREV, NXT, h, h + 1, h + 2, x)
    P[t, x, WHERE] = lst


@njit
def _unlink(P, M, t, x):
    h = _h(P[t, x, WHERE])
    unlink(P, M, t, PREV, NXT, h, h + 1, h + 2, x)
    P[t, x, WHERE] = 0


@njit
def _pop(P, M, t, lst):
    h = _h(lst)
    x = pop_front(P, M, t, PREV, NXT, h, h + 1, h + 2)
    if x != NIL:
        P[t, x, WHERE] = 0


@njit
def _size(M, t, lst):
    return M[t, _h(lst) + 2]


@njit
def init(P, M, X, t, capacity):
    P[t, :, WHERE] = 0
    for lst in range(1, 5):
        h = _h(lst)
        M[t, h] = NIL
        M[t, h + 1] = NIL
        M[t, h + 2] = 0
    M[t, CAP] = capacity
    X[t, P_TARGET] = 0.0


@njit
def _adapt(M, X, t, delta):
    X[t, P_TARGET] = min(max(X[t, P_TARGET] + delta, 0.0), float(M[t, CAP]))


@njit
def _trim_ghosts_for_new(P, M, t):
    c = M[t, CAP]
    if _size(M, t, T1) + _size(M, t, B1) >= c:
        if _size(M, t, B1) > 0:
            _pop(P, M, t, B1)
    elif _size(M, t, T1) + _size(M, t, T2) + _size(M, t, B1) + _size(M, t, B2) >= 2 * c and _size(M, t, B2) > 0:
        _pop(P, M, t, B2)


@njit
def _bound_ghosts(P, M, t):
    room = max(0, 2 * M[t, CAP] - (_size(M, t, T1) + _size(M, t, T2)))
    while _size(M, t, B1) + _size(M, t, B2) > room:
        _pop(P, M, t, B2 if _size(M, t, B2) > 0 else B1)


@njit
def on_insert(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        x = arr[k]
        where = P[t, x, WHERE]
        if where == B1:
            _adapt(M, X, t, max(_size(M, t, B2) / _size(M, t, B1), 1.0))
            _unlink(P, M, t, x)
            _push(P, M, t, T2, x)
        elif where == B2:
            _adapt(M, X, t, -max(_size(M, t, B1) / _size(M, t, B2), 1.0))
            _unlink(P, M, t, x)
            _push(P, M, t, T2, x)
        else:
            _trim_ghosts_for_new(P, M, t)
            _push(P, M, t, T1, x)
    _bound_ghosts(P, M, t)


@njit
def on_access(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        x = arr[k]
        if P[t, x, WHERE] == T1:
            _unlink(P, M, t, x)
            _push(P, M, t, T2, x)
        else:
            h = _h(T2)
            move_to_back(P, M, t, PREV, NXT, h, h + 1, h + 2, x)


@njit
def on_remove(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        x = arr[k]
        ghost = B1 if P[t, x, WHERE] == T1 else B2
        _unlink(P, M, t, x)
        _push(P, M, t, ghost, x)
    _bound_ghosts(P, M, t)


@njit
def _next_unprotected(P, x, t, prot):
    while x != NIL and prot[x] != 0:
        x = P[t, x, NXT]
    return x


@njit
def victims(P, M, X, G, t, n):
    """REPLACE of the paper ``n`` times, walking T1 and T2 from their LRU ends."""
    prot = G[PROT]
    out = P[t, :, P.shape[2] - 1]  # the victims row
    left1 = _size(M, t, T1)
    left2 = _size(M, t, T2)
    cur1 = M[t, _h(T1)]
    cur2 = M[t, _h(T2)]
    p = X[t, P_TARGET]
    found = 0
    while found < n:
        from_t1 = (left1 > 0 and left1 > p) or left2 == 0
        if from_t1:
            cur1 = _next_unprotected(P, cur1, t, prot)
            x = cur1
            if x == NIL:
                cur2 = _next_unprotected(P, cur2, t, prot)
                x = cur2
                from_t1 = False
        else:
            cur2 = _next_unprotected(P, cur2, t, prot)
            x = cur2
            if x == NIL:
                cur1 = _next_unprotected(P, cur1, t, prot)
                x = cur1
                from_t1 = True
        if x == NIL:
            return False
        out[found] = x
        found += 1
        if from_t1:
            cur1 = P[t, cur1, NXT]
            left1 -= 1
        else:
            cur2 = P[t, cur2, NXT]
            left2 -= 1
    return True
