"""Kernel of ``tiercache.policies.lru.LRU``: one list, least recently used at the head."""

from __future__ import annotations

from . import NIL, PROT, njit
from ._lists import move_to_back, push_back, unlink

CODE = 0
BATCH_INSERT_SAFE = True
FIELDS = 2  # rows of P: PREV, NXT
META = 3  # slots of M: HEAD, TAIL, SIZE
PREV, NXT = 0, 1
HEAD, TAIL, SIZE = 0, 1, 2


@njit
def init(P, M, X, t, capacity):
    M[t, HEAD] = NIL
    M[t, TAIL] = NIL
    M[t, SIZE] = 0


@njit
def on_insert(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        push_back(P, M, t, PREV, NXT, HEAD, TAIL, SIZE, arr[k])


@njit
def on_access(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        move_to_back(P, M, t, PREV, NXT, HEAD, TAIL, SIZE, arr[k])


@njit
def on_remove(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        unlink(P, M, t, PREV, NXT, HEAD, TAIL, SIZE, arr[k])


@njit
def victims(P, M, X, G, t, n):
    """The ``n`` least recently used unprotected ids into ``out[:n]``; False if fewer exist."""
    prot = G[PROT]
    out = P[t, :, P.shape[2] - 1]  # the victims row
    return walk(P, M, t, n, prot, out)


@njit
def walk(P, M, t, n, prot, out):
    """Oldest first, skipping protected ids (shared with FIFO)."""
    found = 0
    x = M[t, HEAD]
    while x != NIL and found < n:
        if prot[x] == 0:
            out[found] = x
            found += 1
        x = P[t, x, NXT]
    return found == n
