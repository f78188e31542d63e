"""Kernel of ``tiercache.policies.session.Session`` with its default parameters.

Leaf caches (``leafprio``, key rule ``MODE_SESSION``): each tier's policy in row ``t`` (meta
from column 0 of ``M[t]``), and the top tier's shadows, one per ordering, in the last
``SHADOWS`` rows (meta from column ``SHADOW_BASE + s x META`` of ``M[0]``).
Each shadow replays, in prefix semantics, the ids the policy's hooks see, one at a time, and
counts its misses with a half-life; at each id without parent the policy takes the head
start and frequency scale of the shadow with the fewest (the leader), and when the leader
changes every tracked block is re-keyed under its ordering (``leafprio.rekey``). Victims: the policy's
coldest leaves the leader does not hold (up to ``FOLLOW_BUDGET`` passed over), then leaves
and key order as ``LeafPriorityPolicy.victims``. Real state per row in ``X[r, L + k]``
(``BONUS``, ``FSCALE``, ``MISSES``; ``DECAY`` in the policy's row). Below the top tier the
shadows do not run (``EXPERTS``) and the ordering is ``LOWER_TIER_ORDERING``, as
``Session.for_tier`` builds the class there.
"""

from __future__ import annotations

from ..session import (DEFAULT_EXPERTS, DEFAULT_GHOST, DEFAULT_HOT_BONUS, FOLLOW_BUDGET, LOWER_TIER_ORDERING,
                       SCORE_HALF_LIFE, as_ordering)
from . import META_SLOTS, NIL, as_int, leafprio, njit
from .leafprio import BONUS, CLOCK, DECAY, FSCALE, GCAP, HITTING, LAST, META, MISSES, PICK, SIZE, STATE, TRACKED

CODE = 9
BATCH_INSERT_SAFE = False
FIELDS = leafprio.FIELDS
X_EXTRA = leafprio.X_EXTRA
G_ROWS = leafprio.G_ROWS

_ORDERINGS = ((DEFAULT_HOT_BONUS, 0.0), *(as_ordering(e) for e in DEFAULT_EXPERTS))
#: Head start and frequency scale of each shadow, in capacities (shadow 0: the default ordering).
ORDER_BONUS = tuple(float(b) for b, _ in _ORDERINGS)
ORDER_SCALE = tuple(float(s) for _, s in _ORDERINGS)
#: Head start and frequency scale below the top tier, in capacities (``Session.for_tier``).
LOWER_BONUS, LOWER_SCALE = (float(v) for v in LOWER_TIER_ORDERING)
SHADOWS = len(_ORDERINGS)
#: Rows of P and X beyond one per tier: the top tier's shadows (no other tier runs them).
EXTRA_ROWS = SHADOWS
# Meta slots of M[t] after the policy's own leaf cache.
LEADER = META
CAPACITY = META + 1
SHADOW_BASE = META + 2
#: 1 where the shadows run: the top tier only (``Session.for_tier``: no experts below it).
EXPERTS = SHADOW_BASE + SHADOWS * META
if EXPERTS >= META_SLOTS:
    raise ImportError(f"session kernel: {SHADOWS} shadows need {EXPERTS + 1} meta slots, META_SLOTS is {META_SLOTS}")


@njit
def _shadow_row(P, t, s):
    """Row of shadow ``s`` (of the top tier ``t = 0``: the only one with shadows)."""
    return P.shape[0] - SHADOWS + s


@njit
def init(P, M, X, t, capacity):
    L = P.shape[1]
    leafprio.init_row(P, M, X, t, t, as_int(0), leafprio.MODE_SESSION, capacity)
    M[t, GCAP] = int(DEFAULT_GHOST * capacity)
    X[t, L + BONUS] = (ORDER_BONUS[0] if t == 0 else LOWER_BONUS) * capacity
    X[t, L + FSCALE] = (ORDER_SCALE[0] if t == 0 else LOWER_SCALE) * capacity
    X[t, L + DECAY] = 0.5 ** (1.0 / (SCORE_HALF_LIFE * capacity))
    M[t, LEADER] = 0
    M[t, CAPACITY] = capacity
    M[t, EXPERTS] = 1 if t == 0 else 0
    if t != 0:
        return
    for s in range(SHADOWS):
        r = _shadow_row(P, t, s)
        mb = SHADOW_BASE + s * META
        leafprio.init_row(P, M, X, r, t, mb, leafprio.MODE_SESSION, capacity)
        M[t, mb + GCAP] = int(DEFAULT_GHOST * capacity)
        X[r, L + BONUS] = ORDER_BONUS[s] * capacity
        X[r, L + FSCALE] = ORDER_SCALE[s] * capacity


@njit
def _score(X, M, t, r, mb, clock):
    """A shadow's misses, each weighed by the decay per tick since it happened."""
    L = X.shape[1] - leafprio.X_EXTRA
    return X[r, L + MISSES] * X[t, L + DECAY] ** float(clock - M[t, mb + LAST])


@njit
def _pick_leader(P, M, X, t, clock):
    best = 0
    best_score = _score(X, M, t, _shadow_row(P, t, as_int(0)), as_int(SHADOW_BASE), clock)
    for s in range(1, SHADOWS):
        score = _score(X, M, t, _shadow_row(P, t, s), SHADOW_BASE + s * META, clock)
        if score < best_score:
            best, best_score = s, score
    changed = best != M[t, LEADER]
    M[t, LEADER] = best
    L = P.shape[1]
    r = _shadow_row(P, t, best)
    X[t, L + BONUS] = X[r, L + BONUS]
    X[t, L + FSCALE] = X[r, L + FSCALE]
    if changed:
        leafprio.rekey(P, M, X, t, t, as_int(0))


@njit
def _step(P, M, X, G, t, s, x, parent, clock):
    """``_Shadow.step``: one access of a request (one starts at an id without parent)."""
    r = _shadow_row(P, t, s)
    mb = SHADOW_BASE + s * META
    L = P.shape[1]
    if parent == NIL:
        M[t, mb + HITTING] = 1
    tracked = P[r, x, STATE] == TRACKED
    if not (M[t, mb + HITTING] != 0 and tracked):
        M[t, mb + HITTING] = 0
        X[r, L + MISSES] = _score(X, M, t, r, mb, clock) + 1.0
        M[t, mb + LAST] = clock
    if tracked:
        leafprio.access_one(P, M, X, r, t, mb, x)
        return
    if M[t, mb + SIZE] >= M[t, CAPACITY]:
        leafprio.plain_victims(P, M, X, G, r, t, mb, as_int(1), as_int(0), as_int(0), as_int(0))
        leafprio.remove_one(P, M, X, r, t, mb, P[r, 0, P.shape[2] - 1])
    leafprio.insert_one(P, M, X, r, t, mb, x, parent)


@njit
def _feed(P, M, X, G, t, arr, a, b):
    """``_feed_shadows``: the ids a hook just saw, through every shadow."""
    clock = M[t, CLOCK] - (b - a)
    for k in range(a, b):
        x = arr[k]
        parent = leafprio.parent_at(M, arr, k)
        clock += 1
        if parent == NIL:
            _pick_leader(P, M, X, t, clock)
        for s in range(SHADOWS):
            _step(P, M, X, G, t, s, x, parent, clock)


@njit
def on_insert(P, M, X, G, t, arr, a, b):
    leafprio.insert_run(P, M, X, as_int(t), as_int(t), as_int(0), arr, as_int(a), as_int(b))
    if M[t, EXPERTS]:
        _feed(P, M, X, G, as_int(t), arr, as_int(a), as_int(b))


@njit
def on_access(P, M, X, G, t, arr, a, b):
    leafprio.access_run(P, M, X, as_int(t), as_int(t), as_int(0), arr, as_int(a), as_int(b))
    if M[t, EXPERTS]:
        _feed(P, M, X, G, as_int(t), arr, as_int(a), as_int(b))


@njit
def on_remove(P, M, X, G, t, arr, a, b):
    leafprio.remove_run(P, M, X, as_int(t), as_int(t), as_int(0), arr, as_int(a), as_int(b))


@njit
def victims(P, M, X, G, t, n):
    """Leaves the leader does not hold first (``Session.victims``), then the plain order."""
    return _victims(P, M, X, G, as_int(t), as_int(n))


@njit
def _victims(P, M, X, G, t, n):
    if M[t, EXPERTS] == 0:
        return leafprio.plain_victims(P, M, X, G, t, t, as_int(0), n, as_int(0), as_int(1), as_int(0))
    leader = _shadow_row(P, t, M[t, LEADER])
    found = leafprio.leaf_walk(P, M, X, G, t, t, as_int(0), n, as_int(0), as_int(1), as_int(0), leader, as_int(FOLLOW_BUDGET))
    if found == n:
        return True
    out = P[t, :, P.shape[2] - 1]
    for i in range(found):
        G[PICK, out[i]] += 1
    ok = leafprio.plain_victims(P, M, X, G, t, t, as_int(0), n - found, found, as_int(1), as_int(1))
    for i in range(found):
        G[PICK, out[i]] -= 1
    return ok
