"""Kernel of ``tiercache.policies.leaf_lru.LeafLRU``: prefix-tree leaves, least recently used first.

One leaf cache (``leafprio``) per tier whose key is the tick of the last use.
"""

from __future__ import annotations

from . import as_int, leafprio, njit

CODE = 7
BATCH_INSERT_SAFE = False
FIELDS = leafprio.FIELDS
X_EXTRA = leafprio.X_EXTRA
G_ROWS = leafprio.G_ROWS
SIZE = leafprio.SIZE


@njit
def init(P, M, X, t, capacity):
    leafprio.init_row(P, M, X, t, t, as_int(0), leafprio.MODE_TICK, capacity)


@njit
def on_insert(P, M, X, G, t, arr, a, b):
    leafprio.insert_run(P, M, X, as_int(t), as_int(t), as_int(0), arr, as_int(a), as_int(b))


@njit
def on_access(P, M, X, G, t, arr, a, b):
    leafprio.access_run(P, M, X, as_int(t), as_int(t), as_int(0), arr, as_int(a), as_int(b))


@njit
def on_remove(P, M, X, G, t, arr, a, b):
    leafprio.remove_run(P, M, X, as_int(t), as_int(t), as_int(0), arr, as_int(a), as_int(b))


@njit
def victims(P, M, X, G, t, n):
    return leafprio.plain_victims(P, M, X, G, as_int(t), as_int(t), as_int(0), as_int(n), as_int(0), as_int(1), as_int(0))
