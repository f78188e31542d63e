"""Kernel of ``tiercache.policies.sieve.Sieve``: a FIFO with visited bits and a hand.

The list runs oldest (``HEAD``, the class's ``_tail``) to newest (``TAIL``, the class's
``_head``); ``NXT`` points to the newer neighbour.
"""

from __future__ import annotations

from . import NIL, PROT, njit
from ._lists import push_back, unlink

CODE = 5
BATCH_INSERT_SAFE = False
FIELDS = 4
META = 4
PREV, NXT, VISITED, PICKED = 0, 1, 2, 3
HEAD, TAIL, SIZE, HAND = 0, 1, 2, 3


@njit
def init(P, M, X, t, capacity):
    P[t, :, PICKED] = 0
    M[t, HEAD] = NIL
    M[t, TAIL] = NIL
    M[t, SIZE] = 0
    M[t, HAND] = NIL


@njit
def on_insert(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        x = arr[k]
        P[t, x, VISITED] = 0
        push_back(P, M, t, PREV, NXT, HEAD, TAIL, SIZE, x)


@njit
def on_access(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        P[t, arr[k], VISITED] = 1


@njit
def on_remove(P, M, X, G, t, arr, a, b):
    for k in range(a, b):
        x = arr[k]
        if M[t, HAND] == x:
            M[t, HAND] = P[t, x, NXT]  # NIL: the next sweep starts from the oldest again
        unlink(P, M, t, PREV, NXT, HEAD, TAIL, SIZE, x)


@njit
def victims(P, M, X, G, t, n):
    prot = G[PROT]
    out = P[t, :, P.shape[2] - 1]  # the victims row
    if n <= 0:
        return True
    found = 0
    x = M[t, HEAD]
    while x != NIL and found < n:
        if prot[x] == 0:
            found += 1
        x = P[t, x, NXT]
    if found < n:
        return False  # checked first: the sweep clears bits
    chosen = 0
    node = M[t, HAND] if M[t, HAND] != NIL else M[t, HEAD]
    while True:
        if prot[node] == 0 and P[t, node, PICKED] == 0:
            if P[t, node, VISITED] != 0:
                P[t, node, VISITED] = 0
            else:
                out[chosen] = node
                chosen += 1
                if chosen == n:
                    break
                P[t, node, PICKED] = 1
        node = P[t, node, NXT]
        if node == NIL:
            node = M[t, HEAD]
    M[t, HAND] = node
    for k in range(n):
        P[t, out[k], PICKED] = 0
    return True
