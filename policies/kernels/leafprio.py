"""The prefix-tree leaf caches of the ``leaf_lru``, ``cost`` and ``session`` kernels.

Mirrors ``LeafPriorityPolicy`` (``tiercache.policies._leafprio``) and ``LeafLRU`` over array
state: the tracked blocks' prefix tree (parent and tracked-child count per id) and the
leaves in a binary min-heap ordered by (key, seq), where seq numbers the re-keyings in order.
That is the order ``LazyHeap`` pops in (its entries are (key, seq, id) with unique seq), so
the heap's layout may differ while every victim comes out the same.

A *leaf cache* is one row ``r`` of ``P`` and ``X`` plus ``META`` slots of ``M`` row ``t``
from column ``mb``: a tier's policy is row ``t`` at ``mb = 0``; ``session``'s shadow caches
are further rows of ``P`` and ``X`` with their meta beside the main one's in ``M[t]``.

Per id (fields of ``P[r]``): ``PAR`` the parent given on insert (NIL: a root), ``NCH`` how
many tracked ids name it as parent (counted for untracked parents too, as the Python class
does), ``HPOS`` its heap position (NIL: not a leaf, or untracked), ``SEQ`` its live entry's
seq, ``STATE`` (untracked, tracked, or a ghost whose use count is kept), ``USES``, ``DEPTH``
(``cost``; ``session`` keeps the tick of the last use there), ghost FIFO links; the key is ``X[r, id]``. The heap itself
is the ``HEAP`` field read by position. Columns ``L ..`` of ``X[r]`` hold real parameters.

Victim walks use the scratch rows of ``G`` (``FREED``, ``TAKEN``, ``EXPO``, ``PICK``,
``SORTBUF``), which no other code touches and every walk leaves as it found them. Ties of key
among exposed parents and in key order go to the lower *trace* id, as in the Python class:
``G[ORIG, x]`` is dense id ``x``'s id in the trace (the identity unless the replay sets it).

Parents come from the chain (``S_PARENTS``, ``S_REQ`` in ``M``'s last row): when the ids a
hook gets are the trace's, the parent of ``arr[k]`` is ``arr[k - 1]`` unless ``k`` starts the
request or repeats that id (``replay``'s ``Hints.parents``); blocks moved between tiers get none.
"""

from __future__ import annotations

import math

from . import G_ROWS as SHARED_ROWS
from . import NIL, PROT, S_PARENTS, S_REQ, as_int, njit, njit_inline

# Fields of a leaf cache's row of P (the victims column follows).
PAR, NCH, HPOS, SEQ, HEAP, USES, DEPTH, STATE, GPREV, GNEXT = range(10)
FIELDS = 10
# STATE values.
UNTRACKED, TRACKED, GHOST = 0, 1, 2
# Meta slots of a leaf cache, from its base column mb of M[t].
HSIZE, SIZE, CLOCK, SEQC, GHEAD, GTAIL, GSIZE, GCAP, HITTING, LAST, MODE = range(11)
META = 11
# Key rules (MODE).
MODE_TICK, MODE_COST, MODE_SESSION = 0, 1, 2
# Real parameters and state, at X[r, L + k].
INFL, DSCALE, BONUS, FSCALE, MISSES, DECAY = range(6)
X_EXTRA = 6
# Scratch rows of G, after the rows every kernel shares.
FREED, TAKEN, EXPO, PICK, SORTBUF, ORIG = range(SHARED_ROWS, SHARED_ROWS + 6)
G_ROWS = SHARED_ROWS + 6


@njit
def init_row(P, M, X, r, t, mb, mode, capacity):
    """An empty leaf cache in row ``r`` (meta from column ``mb`` of ``M[t]``)."""
    P[r, :, PAR] = NIL
    P[r, :, NCH] = 0
    P[r, :, HPOS] = NIL
    P[r, :, STATE] = UNTRACKED
    P[r, :, USES] = 0
    P[r, :, GPREV] = NIL
    P[r, :, GNEXT] = NIL
    for k in range(META):
        M[t, mb + k] = 0
    M[t, mb + GHEAD] = NIL
    M[t, mb + GTAIL] = NIL
    M[t, mb + MODE] = mode
    L = P.shape[1]
    X[r, :] = 0.0
    X[r, L + DSCALE] = 1.0


# -- the heap of leaves, by (key, seq) -----------------------------------------------------------
@njit_inline
def _less(P, X, r, a, b):
    ka = X[r, a]
    kb = X[r, b]
    return ka < kb or (ka == kb and P[r, a, SEQ] < P[r, b, SEQ])


@njit
def _sift_up(P, X, r, pos):
    x = P[r, pos, HEAP]
    while pos > 0:
        up = (pos - 1) >> 1
        y = P[r, up, HEAP]
        if not _less(P, X, r, x, y):
            break
        P[r, pos, HEAP] = y
        P[r, y, HPOS] = pos
        pos = up
    P[r, pos, HEAP] = x
    P[r, x, HPOS] = pos


@njit
def _sift_down(P, X, r, n, pos):
    x = P[r, pos, HEAP]
    while True:
        c = 2 * pos + 1
        if c >= n:
            break
        if c + 1 < n and _less(P, X, r, P[r, c + 1, HEAP], P[r, c, HEAP]):
            c += 1
        y = P[r, c, HEAP]
        if not _less(P, X, r, y, x):
            break
        P[r, pos, HEAP] = y
        P[r, y, HPOS] = pos
        pos = c
    P[r, pos, HEAP] = x
    P[r, x, HPOS] = pos


@njit
def _heap_push(P, M, X, r, t, mb, x):
    pos = M[t, mb + HSIZE]
    M[t, mb + HSIZE] = pos + 1
    P[r, pos, HEAP] = x
    _sift_up(P, X, r, pos)


@njit
def _heap_delete(P, M, X, r, t, mb, x):
    pos = P[r, x, HPOS]
    P[r, x, HPOS] = NIL
    n = M[t, mb + HSIZE] - 1
    M[t, mb + HSIZE] = n
    if pos != n:
        last = P[r, n, HEAP]
        P[r, pos, HEAP] = last
        P[r, last, HPOS] = pos
        _sift_down(P, X, r, n, pos)
        if P[r, last, HPOS] == pos:
            _sift_up(P, X, r, pos)


@njit
def _leaf_set(P, M, X, r, t, mb, x):
    """``LazyHeap.set``: x's entry gets the next seq and its key ``X[r, x]``."""
    M[t, mb + SEQC] += 1
    P[r, x, SEQ] = M[t, mb + SEQC]
    pos = P[r, x, HPOS]
    if pos == NIL:
        _heap_push(P, M, X, r, t, mb, x)
    else:
        _sift_up(P, X, r, pos)
        if P[r, x, HPOS] == pos:
            _sift_down(P, X, r, M[t, mb + HSIZE], pos)


@njit_inline
def _set_key(P, M, X, r, t, mb, x, key):
    X[r, x] = key
    if P[r, x, NCH] == 0:
        _leaf_set(P, M, X, r, t, mb, x)


@njit_inline
def _add_child(P, M, X, r, t, mb, p):
    P[r, p, NCH] += 1
    if P[r, p, NCH] == 1 and P[r, p, HPOS] != NIL:
        _heap_delete(P, M, X, r, t, mb, p)  # a tracked parent stops being a leaf


@njit_inline
def _drop_child(P, M, X, r, t, mb, p):
    P[r, p, NCH] -= 1
    if P[r, p, NCH] == 0 and P[r, p, STATE] == TRACKED:
        _leaf_set(P, M, X, r, t, mb, p)  # the parent is a leaf again


# -- ghosts (session): use counts of evicted ids, oldest first -----------------------------------
@njit
def _ghost_unlink(P, M, r, t, mb, x):
    before = P[r, x, GPREV]
    after = P[r, x, GNEXT]
    if before == NIL:
        M[t, mb + GHEAD] = after
    else:
        P[r, before, GNEXT] = after
    if after == NIL:
        M[t, mb + GTAIL] = before
    else:
        P[r, after, GPREV] = before
    P[r, x, GPREV] = NIL
    P[r, x, GNEXT] = NIL
    M[t, mb + GSIZE] -= 1


@njit
def _forget(P, M, X, r, t, mb, x):
    """``_forget``: the id stops being tracked; session keeps its use count in the ghost."""
    if M[t, mb + MODE] != MODE_SESSION or M[t, mb + GCAP] == 0:
        P[r, x, STATE] = UNTRACKED
        P[r, x, USES] = 0
        return
    P[r, x, STATE] = GHOST
    last = M[t, mb + GTAIL]
    P[r, x, GPREV] = last
    P[r, x, GNEXT] = NIL
    if last == NIL:
        M[t, mb + GHEAD] = x
    else:
        P[r, last, GNEXT] = x
    M[t, mb + GTAIL] = x
    M[t, mb + GSIZE] += 1
    if M[t, mb + GSIZE] > M[t, mb + GCAP]:
        oldest = M[t, mb + GHEAD]
        _ghost_unlink(P, M, r, t, mb, oldest)
        P[r, oldest, STATE] = UNTRACKED
        P[r, oldest, USES] = 0


# -- keys ------------------------------------------------------------------------------------------
@njit
def _key_after(P, M, X, r, t, mb, x, parent, inserted):
    """The key of ``x`` after an insert or an access at the current clock (``_key_after``)."""
    mode = M[t, mb + MODE]
    clock = M[t, mb + CLOCK]
    if mode == MODE_TICK:
        return float(clock)
    L = P.shape[1]
    uses = P[r, x, USES] + 1
    P[r, x, USES] = uses
    if mode == MODE_COST:
        if inserted != 0:
            if parent != NIL and P[r, parent, STATE] == TRACKED:
                P[r, x, DEPTH] = P[r, parent, DEPTH] + 1
            else:
                P[r, x, DEPTH] = 0
        return X[r, L + INFL] + uses * (1.0 + P[r, x, DEPTH] / X[r, L + DSCALE])
    P[r, x, DEPTH] = clock  # session: the tick of the last use (re-keying needs it)
    return session_key(X, r, L, clock, uses)


@njit
def session_key(X, r, L, tick, uses):
    """Session's key: the last-use tick, plus the head start once used twice, plus the
    frequency term (``Session._key_after``)."""
    if uses < 2:
        return float(tick)
    key = tick + X[r, L + BONUS]
    scale = X[r, L + FSCALE]
    if scale != 0.0:
        return key + scale * math.log2(uses)
    return key


@njit
def rekey(P, M, X, r, t, mb):
    """Every tracked id's key under the row's current head start and frequency scale (session,
    after the leader changed); the leaves' entries get seqs in order of last use, above every
    earlier seq, and the heap is rebuilt (``Session._rekey``)."""
    L = P.shape[1]
    base = M[t, mb + SEQC]
    for x in range(L):
        if P[r, x, STATE] == TRACKED:
            tick = P[r, x, DEPTH]
            X[r, x] = session_key(X, r, L, tick, P[r, x, USES])
            if P[r, x, HPOS] != NIL:
                P[r, x, SEQ] = base + tick
    M[t, mb + SEQC] = base + M[t, mb + CLOCK] + 1
    n = M[t, mb + HSIZE]
    for pos in range(n // 2 - 1, -1, -1):
        _sift_down(P, X, r, n, pos)


# -- one id through a leaf cache -------------------------------------------------------------------
@njit
def insert_one(P, M, X, r, t, mb, x, parent):
    """``on_insert((x,), parents=(parent,))``: x must be untracked."""
    M[t, mb + CLOCK] += 1
    if P[r, x, STATE] == GHOST:
        _ghost_unlink(P, M, r, t, mb, x)
    P[r, x, STATE] = TRACKED
    P[r, x, PAR] = parent
    M[t, mb + SIZE] += 1
    if parent != NIL:
        _add_child(P, M, X, r, t, mb, parent)
    _set_key(P, M, X, r, t, mb, x, _key_after(P, M, X, r, t, mb, x, parent, as_int(1)))


@njit
def access_one(P, M, X, r, t, mb, x):
    """``on_access((x,))``: x must be tracked."""
    M[t, mb + CLOCK] += 1
    _set_key(P, M, X, r, t, mb, x, _key_after(P, M, X, r, t, mb, x, P[r, x, PAR], as_int(0)))


@njit
def remove_one(P, M, X, r, t, mb, x):
    """``on_remove((x,))``: x must be tracked (cost's inflation is the caller's)."""
    if P[r, x, HPOS] != NIL:
        _heap_delete(P, M, X, r, t, mb, x)
    parent = P[r, x, PAR]
    P[r, x, PAR] = NIL
    M[t, mb + SIZE] -= 1
    _forget(P, M, X, r, t, mb, x)
    if parent != NIL:
        _drop_child(P, M, X, r, t, mb, parent)


@njit_inline
def parent_at(M, arr, k):
    """The parent the chain gives ``arr[k]`` (see the module docstring)."""
    T = M.shape[0] - 1
    if M[T, S_PARENTS] == 0 or k <= M[T, S_REQ] or arr[k - 1] == arr[k]:
        return NIL
    return arr[k - 1]


@njit
def insert_run(P, M, X, r, t, mb, arr, a, b):
    for k in range(a, b):
        insert_one(P, M, X, r, t, mb, arr[k], parent_at(M, arr, k))


@njit
def access_run(P, M, X, r, t, mb, arr, a, b):
    for k in range(a, b):
        access_one(P, M, X, r, t, mb, arr[k])


@njit
def remove_run(P, M, X, r, t, mb, arr, a, b):
    L = P.shape[1]
    if M[t, mb + MODE] == MODE_COST:
        for k in range(a, b):
            X[r, L + INFL] = max(X[r, L + INFL], X[r, arr[k]])
    for k in range(a, b):
        remove_one(P, M, X, r, t, mb, arr[k])


# -- victims ---------------------------------------------------------------------------------------
@njit_inline
def _id_less(X, G, r, a, b):
    """(key, trace id) of ``a`` below that of ``b``."""
    return X[r, a] < X[r, b] or (X[r, a] == X[r, b] and G[ORIG, a] < G[ORIG, b])


@njit
def _expo_push(X, G, r, n, x):
    """Pushes ``x`` on the exposed-parents heap ``G[EXPO, :n]`` (by (key, id))."""
    pos = n
    while pos > 0:
        up = (pos - 1) >> 1
        y = G[EXPO, up]
        if not _id_less(X, G, r, x, y):
            break
        G[EXPO, pos] = y
        pos = up
    G[EXPO, pos] = x


@njit
def _expo_pop(X, G, r, n):
    top = G[EXPO, 0]
    n -= 1
    if n > 0:
        x = G[EXPO, n]
        pos = 0
        while True:
            c = 2 * pos + 1
            if c >= n:
                break
            if c + 1 < n and _id_less(X, G, r, G[EXPO, c + 1], G[EXPO, c]):
                c += 1
            if not _id_less(X, G, r, G[EXPO, c], x):
                break
            G[EXPO, pos] = G[EXPO, c]
            pos = c
        G[EXPO, pos] = x
    return top


@njit
def leaf_walk(P, M, X, G, r, t, mb, n, start, check_prot, use_pick, avoid_r, budget):
    """``_leaf_victims``: up to ``n`` leaves by key into the victims column from ``start``,
    parents exposed on the way included; returns how many.

    Skipped: ids ``G[PROT]`` marks (with ``check_prot`` nonzero), ids ``G[PICK]`` marks (with
    ``use_pick`` nonzero; flags are ints, see ``as_int``), and ids tracked in row ``avoid_r`` (when >= 0), at most ``budget`` of
    those: the walk stops at the ``budget``-th.
    """
    out = P[r, :, P.shape[2] - 1]
    taken = 0
    nexp = 0
    found = 0
    while found < n:
        if M[t, mb + HSIZE] > 0 and (nexp == 0 or X[r, P[r, 0, HEAP]] < X[r, G[EXPO, 0]]):
            x = P[r, 0, HEAP]
            _heap_delete(P, M, X, r, t, mb, x)
            G[TAKEN, taken] = x
            taken += 1
        elif nexp > 0:
            x = _expo_pop(X, G, r, nexp)
            nexp -= 1
        else:
            break
        if (check_prot != 0 and G[PROT, x] != 0) or (use_pick != 0 and G[PICK, x] != 0):
            continue
        if avoid_r >= 0 and P[avoid_r, x, STATE] == TRACKED:
            budget -= 1
            if budget <= 0:
                break
            continue
        out[start + found] = x
        found += 1
        p = P[r, x, PAR]
        if p != NIL and P[r, p, STATE] == TRACKED:
            G[FREED, p] += 1
            if G[FREED, p] == P[r, p, NCH]:
                _expo_push(X, G, r, nexp, p)
                nexp += 1
    for i in range(taken):  # restore: same keys, same seqs
        _heap_push(P, M, X, r, t, mb, G[TAKEN, i])
    for i in range(start, start + found):
        p = P[r, out[i], PAR]
        if p != NIL:
            G[FREED, p] = 0
    return found


@njit
def _key_order(P, X, G, r, n, start, check_prot):
    """``_key_order_victims``: up to ``n`` tracked ids by (key, id), none marked in ``G[PICK]``
    (nor ``G[PROT]`` with ``check_prot``), into the victims column from ``start``. A scan of
    every id: only reached when protected ids hide the leaves."""
    out = P[r, :, P.shape[2] - 1]
    have = 0
    for x in range(P.shape[1]):
        if P[r, x, STATE] != TRACKED or G[PICK, x] != 0 or (check_prot != 0 and G[PROT, x] != 0):
            continue
        if have == n and not _id_less(X, G, r, x, G[SORTBUF, n - 1]):
            continue
        pos = have if have < n else n - 1
        while pos > 0 and _id_less(X, G, r, x, G[SORTBUF, pos - 1]):
            G[SORTBUF, pos] = G[SORTBUF, pos - 1]
            pos -= 1
        G[SORTBUF, pos] = x
        if have < n:
            have += 1
    for i in range(have):
        out[start + i] = G[SORTBUF, i]
    return have


@njit
def plain_victims(P, M, X, G, r, t, mb, n, start, check_prot, use_pick):
    """``LeafPriorityPolicy.victims``: leaves first, then key order; ``n`` ids into the victims
    column from ``start``, or False when fewer exist."""
    leaves = leaf_walk(P, M, X, G, r, t, mb, n, start, check_prot, use_pick, as_int(NIL), as_int(0))
    if leaves == n:
        return True
    out = P[r, :, P.shape[2] - 1]
    for i in range(start, start + leaves):
        G[PICK, out[i]] += 1
    more = _key_order(P, X, G, r, n - leaves, start + leaves, check_prot)
    for i in range(start, start + leaves):
        G[PICK, out[i]] -= 1
    return leaves + more == n
