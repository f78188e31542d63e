"""Doubly linked lists over the per-id link rows of a kernel's state (oldest at the head).

A list is named by the rows of its links (``prev``, ``nxt`` in ``P[t]``) and the meta slots of
its head, tail and size (``M[t]``). Several lists may share one pair of link rows when an id
is in at most one of them at a time (ARC's four lists, S3-FIFO's three queues).
"""

from __future__ import annotations

from . import NIL, njit


@njit
def push_back(P, M, t, prev, nxt, head, tail, size, x):
    """Appends ``x`` at the tail (newest end)."""
    last = M[t, tail]
    P[t, x, prev] = last
    P[t, x, nxt] = NIL
    if last == NIL:
        M[t, head] = x
    else:
        P[t, last, nxt] = x
    M[t, tail] = x
    M[t, size] += 1


@njit
def push_front(P, M, t, prev, nxt, head, tail, size, x):
    """Puts ``x`` at the head (oldest end)."""
    first = M[t, head]
    P[t, x, nxt] = first
    P[t, x, prev] = NIL
    if first == NIL:
        M[t, tail] = x
    else:
        P[t, first, prev] = x
    M[t, head] = x
    M[t, size] += 1


@njit
def unlink(P, M, t, prev, nxt, head, tail, size, x):
    """Takes ``x`` out of its list."""
    before = P[t, x, prev]
    after = P[t, x, nxt]
    if before == NIL:
        M[t, head] = after
    else:
        P[t, before, nxt] = after
    if after == NIL:
        M[t, tail] = before
    else:
        P[t, after, prev] = before
    M[t, size] -= 1


@njit
def pop_front(P, M, t, prev, nxt, head, tail, size):
    """Unlinks and returns the head (oldest), or NIL when empty."""
    x = M[t, head]
    if x != NIL:
        unlink(P, M, t, prev, nxt, head, tail, size, x)
    return x


@njit
def move_to_back(P, M, t, prev, nxt, head, tail, size, x):
    """Makes ``x`` the newest entry of its list."""
    if M[t, tail] != x:
        unlink(P, M, t, prev, nxt, head, tail, size, x)
        push_back(P, M, t, prev, nxt, head, tail, size, x)
