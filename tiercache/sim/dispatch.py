"""Dispatch from the compiled access path (``tiercache.sim.chain``) to the policy kernels by
their ``CODE``: one branch per registered kernel, inlined into the caller (split out of
``chain`` to keep modules small)."""

from __future__ import annotations

from tiercache.policies.kernels import njit, njit_inline
from tiercache.policies.kernels import arc, belady, cost, fifo, leaf_lru, lfu, lru, s3fifo, session, sieve

__all__ = ["p_insert", "p_access", "p_remove", "p_victims", "p_init"]


@njit_inline
def p_insert(kind, P, M, X, G, t, arr, a, b):
    if kind == lru.CODE:
        lru.on_insert(P, M, X, G, t, arr, a, b)
    elif kind == fifo.CODE:
        fifo.on_insert(P, M, X, G, t, arr, a, b)
    elif kind == lfu.CODE:
        lfu.on_insert(P, M, X, G, t, arr, a, b)
    elif kind == arc.CODE:
        arc.on_insert(P, M, X, G, t, arr, a, b)
    elif kind == s3fifo.CODE:
        s3fifo.on_insert(P, M, X, G, t, arr, a, b)
    elif kind == sieve.CODE:
        sieve.on_insert(P, M, X, G, t, arr, a, b)
    elif kind == leaf_lru.CODE:
        leaf_lru.on_insert(P, M, X, G, t, arr, a, b)
    elif kind == cost.CODE:
        cost.on_insert(P, M, X, G, t, arr, a, b)
    elif kind == session.CODE:
        session.on_insert(P, M, X, G, t, arr, a, b)
    else:
        belady.on_insert(P, M, X, G, t, arr, a, b)


@njit_inline
def p_access(kind, P, M, X, G, t, arr, a, b):
    if kind == lru.CODE:
        lru.on_access(P, M, X, G, t, arr, a, b)
    elif kind == fifo.CODE:
        fifo.on_access(P, M, X, G, t, arr, a, b)
    elif kind == lfu.CODE:
        lfu.on_access(P, M, X, G, t, arr, a, b)
    elif kind == arc.CODE:
        arc.on_access(P, M, X, G, t, arr, a, b)
    elif kind == s3fifo.CODE:
        s3fifo.on_access(P, M, X, G, t, arr, a, b)
    elif kind == sieve.CODE:
        sieve.on_access(P, M, X, G, t, arr, a, b)
    elif kind == leaf_lru.CODE:
        leaf_lru.on_access(P, M, X, G, t, arr, a, b)
    elif kind == cost.CODE:
        cost.on_access(P, M, X, G, t, arr, a, b)
    elif kind == session.CODE:
        session.on_access(P, M, X, G, t, arr, a, b)
    else:
        belady.on_access(P, M, X, G, t, arr, a, b)


@njit_inline
def p_remove(kind, P, M, X, G, t, arr, a, b):
    if kind == lru.CODE:
        lru.on_remove(P, M, X, G, t, arr, a, b)
    elif kind == fifo.CODE:
        fifo.on_remove(P, M, X, G, t, arr, a, b)
    elif kind == lfu.CODE:
        lfu.on_remove(P, M, X, G, t, arr, a, b)
    elif kind == arc.CODE:
        arc.on_remove(P, M, X, G, t, arr, a, b)
    elif kind == s3fifo.CODE:
        s3fifo.on_remove(P, M, X, G, t, arr, a, b)
    elif kind == sieve.CODE:
        sieve.on_remove(P, M, X, G, t, arr, a, b)
    elif kind == leaf_lru.CODE:
        leaf_lru.on_remove(P, M, X, G, t, arr, a, b)
    elif kind == cost.CODE:
        cost.on_remove(P, M, X, G, t, arr, a, b)
    elif kind == session.CODE:
        session.on_remove(P, M, X, G, t, arr, a, b)
    else:
        belady.on_remove(P, M, X, G, t, arr, a, b)


@njit_inline
def p_victims(kind, P, M, X, G, t, n):
    """Chooses ``n`` victims of tier ``t`` into ``P[t, :n, -1]``; False (nothing changed) if
    fewer than ``n`` unprotected ids are tracked."""
    if kind == lru.CODE:
        return lru.victims(P, M, X, G, t, n)
    if kind == fifo.CODE:
        return fifo.victims(P, M, X, G, t, n)
    if kind == lfu.CODE:
        return lfu.victims(P, M, X, G, t, n)
    if kind == arc.CODE:
        return arc.victims(P, M, X, G, t, n)
    if kind == s3fifo.CODE:
        return s3fifo.victims(P, M, X, G, t, n)
    if kind == sieve.CODE:
        return sieve.victims(P, M, X, G, t, n)
    if kind == leaf_lru.CODE:
        return leaf_lru.victims(P, M, X, G, t, n)
    if kind == cost.CODE:
        return cost.victims(P, M, X, G, t, n)
    if kind == session.CODE:
        return session.victims(P, M, X, G, t, n)
    return belady.victims(P, M, X, G, t, n)


@njit
def p_init(kind, P, M, X, t, capacity):
    if kind == lru.CODE:
        lru.init(P, M, X, t, capacity)
    elif kind == fifo.CODE:
        fifo.init(P, M, X, t, capacity)
    elif kind == lfu.CODE:
        lfu.init(P, M, X, t, capacity)
    elif kind == arc.CODE:
        arc.init(P, M, X, t, capacity)
    elif kind == s3fifo.CODE:
        s3fifo.init(P, M, X, t, capacity)
    elif kind == sieve.CODE:
        sieve.init(P, M, X, t, capacity)
    elif kind == leaf_lru.CODE:
        leaf_lru.init(P, M, X, t, capacity)
    elif kind == cost.CODE:
        cost.init(P, M, X, t, capacity)
    elif kind == session.CODE:
        session.init(P, M, X, t, capacity)
    else:
        belady.init(P, M, X, t, capacity)
