"""Kernel of ``tiercache.policies.fifo.FIFO``: one list in insertion order; hits change nothing."""

from __future__ import annotations

from . import njit
from . import lru

CODE = 1
BATCH_INSERT_SAFE = True
FIELDS = lru.FIELDS
META = lru.META
init = lru.init
on_insert = lru.on_insert
on_remove = lru.on_remove
victims = lru.victims


@njit
def on_access(P, M, X, G, t, arr, a, b):
    """Hits leave the insertion order as it is."""
    return
