"""The compiled access path of a replay: a request through a hierarchy of kernel policies.

Mirrors ``TierManager.access`` (``tiercache.core.manager``) call for call for an exclusive
hierarchy whose tiers admit everything, with every move completing at once (a replay):
runs of top-tier hits are touched in one ``on_access``; a run of distinct ids absent from
the top is split into segments by the tier holding them; a missing segment is inserted in
the pieces ``TierManager._place_chunks`` uses (room made first, victims demoted down the
chain, past a tier that cannot give up victims, victims of the last tier dropped); a segment
found below is touched there, room is made in the top tier (the segment protected all the
way down) and it moves up in one transfer (in pieces when the run holds the room its victims
need), or stays and is read in place when no room can be made without pushing blocks out
past a full tier (``tiercache.core.room``). A segment found
below by a read without hits (prefix semantics after the first miss) is recomputed: room is
made the same way and it moves to the top tier with no transfer, or stays. The Python
manager is the reference: ``tests/test_kernels.py`` compares both on every registered policy.

State (layout in ``tiercache.policies.kernels``): ``P``, ``X`` and the first ``META_SLOTS``
columns of ``M`` belong to the policy kernels; ``G`` holds per-id rows (``TIER_OF``: the one
tier holding the id, -1 for none; ``PROT``: guards on it, a victim only at 0; ``STAMP``: scratch marks;
``FUT``: next use as last seen, which a demoted block carries; ``HINT``: the next use the
next hook call passes, as ``Hints.next_use``); the chain's columns of ``M``
row ``t`` hold tier ``t``'s capacity, used slots, victims of the current cascade, counters
(``C_*``; a top tier that is not HBM also counts its hits' reads to HBM and the writes of
computed blocks into it) and blocks / transfers moved to each tier (``LINK_BLOCKS + dst``,
``LINK_TRANSFERS + dst``); row ``tiers`` holds the totals (``S_*``).

No plans, no events: the counters are what ``HierarchyStats`` and ``HitMeter`` would have
counted from the events of the Python manager.
"""

from __future__ import annotations

from tiercache.policies.kernels import FUT, HINT, META_SLOTS, PROT, S_PARENTS, S_REQ, STAMP, TIER_OF, njit, njit_inline

from .dispatch import p_access, p_init, p_insert, p_remove, p_victims

__all__ = ["access", "run_requests", "prefix_length"]

MAX_TIERS = 8
# Columns of M (tier rows) after the kernel's meta slots.
CAP, USED, VN = META_SLOTS, META_SLOTS + 1, META_SLOTS + 2
C_HITS, C_INSERTS, C_EVICTIONS, C_DEMOTIONS, C_PROMOTIONS, C_REFUSED, C_PSKIP = range(META_SLOTS + 3, META_SLOTS + 10)
C_IN_PLACE, C_HIT_PROMOTED, C_HIT_PROMOTE_RUNS, C_READ_THROUGHS = range(META_SLOTS + 10, META_SLOTS + 14)
# Blocks written into the top tier from where they were computed (new and recomputed ones), and
# the writes (``SimEngine.fill`` calls): charged when the top tier is not HBM.
C_FILLED, C_FILLS = META_SLOTS + 14, META_SLOTS + 15
LINK_BLOCKS = META_SLOTS + 16
LINK_TRANSFERS = LINK_BLOCKS + MAX_TIERS
DST = LINK_TRANSFERS + MAX_TIERS  # where the current cascade sends this tier's victims
# The insert chunk (``S_GROUP``) that last counted a transfer on each link from this tier
# (``MARK + dst``), and one of the top tier's fills (``FILL_MARK``, row 0): ``_count_transfer``.
MARK = DST + 1
FILL_MARK = MARK + MAX_TIERS
WIDTH = FILL_MARK + 1
# Columns of M's last row (totals and flags; S_PARENTS = 5 and S_REQ = 6 are read by the kernels,
# and set only when S_NEEDS_PARENTS: the policy's kernel reads parents).
# S_CHUNK: the largest piece of new blocks placed at once (``TierManager._place_chunks``): the
# smallest tier's capacity for a batch-safe policy, else 1.
S_EPOCH, S_MISSES, S_RECOMPUTED, S_CHUNK, S_NEEDS_FUTURE = 0, 1, 2, 3, 4
S_NEEDS_PARENTS = 7
# ids[S_KEEP_A:S_KEEP_B]: the cached prefix being read (``keep_all`` of the manager's access),
# never victims of the last tier.
S_KEEP_A, S_KEEP_B = 8, 9
# S_GROUP: the insert chunk being placed (``_insert_new``; 0 outside one), S_GROUPS: chunks so
# far, S_GROUP_CAP: the chunk size of ``TierManager._insert_chunks`` for every policy (the
# smallest tier's capacity; a policy that is not batch-safe places it one id at a time).
S_GROUP, S_GROUPS, S_GROUP_CAP = 10, 11, 12
MADE, NO_VICTIMS = 0, 1


@njit
def init_all(kind, P, M, X):
    for t in range(M.shape[0] - 1):
        p_init(kind, P, M, X, t, M[t, CAP])


# -- next-use hints (Belady) -----------------------------------------------------------------
@njit_inline
def _hint_trace(M, G, ids, nus, a, b):
    """Hook calls on trace ids ``ids[a:b]`` pass each access's own next use, and parents."""
    T = M.shape[0] - 1
    if M[T, S_NEEDS_PARENTS]:
        M[T, S_PARENTS] = 1
    if M[T, S_NEEDS_FUTURE]:
        for k in range(a, b):
            G[HINT, ids[k]] = nus[k]


@njit_inline
def _see_future(M, G, ids, nus, a, b):
    """``FUT`` of ``ids[a:b]`` becomes their next use as they are accessed, not before (the
    manager's ``_see_future``): a block of the request not reached yet keeps its next use as
    last seen, the access about to come."""
    if M[M.shape[0] - 1, S_NEEDS_FUTURE]:
        for k in range(a, b):
            G[FUT, ids[k]] = nus[k]


@njit_inline
def _hint_future(M, G, arr, a, b):
    """Demoted blocks carry their last known next use (the manager's ``_future_hints``) and
    no parents."""
    T = M.shape[0] - 1
    if M[T, S_NEEDS_PARENTS]:
        M[T, S_PARENTS] = 0
    if M[T, S_NEEDS_FUTURE]:
        for k in range(a, b):
            G[HINT, arr[k]] = G[FUT, arr[k]]


# -- moves -----------------------------------------------------------------------------------
@njit
def _move(kind, P, M, X, G, arr, a, b, src, dst):
    """One transfer of ``arr[a:b]`` from ``src`` to ``dst`` (``complete`` of the manager)."""
    p_remove(kind, P, M, X, G, src, arr, a, b)
    for k in range(a, b):
        G[TIER_OF, arr[k]] = dst
    n = b - a
    M[src, USED] -= n
    M[dst, USED] += n
    p_insert(kind, P, M, X, G, dst, arr, a, b)
    M[src, LINK_BLOCKS + dst] += n
    _count_transfer(M, src, LINK_TRANSFERS + dst, MARK + dst)


@njit_inline
def _count_transfer(M, row, count, mark):
    """Counts a transfer in ``M[row, count]``, unless the insert chunk being placed
    (``S_GROUP``) already counted one on that link (``M[row, mark]``): the one-at-a-time
    inserts of a chunk are charged as one transfer per link, as a batch-safe policy's single
    placement of the chunk is (``SimEngine.coalesce``)."""
    group = M[M.shape[0] - 1, S_GROUP]
    if group == 0 or M[row, mark] != group:
        M[row, count] += 1
        M[row, mark] = group


@njit_inline
def _next_group(M):
    """Starts the next insert chunk (``S_GROUP``)."""
    T = M.shape[0] - 1
    M[T, S_GROUPS] += 1
    M[T, S_GROUP] = M[T, S_GROUPS]


@njit_inline
def _drop(kind, P, M, X, G, t, n):
    """The victims ``P[t, :n, -1]`` of tier ``t`` leave the hierarchy."""
    arr = P[t, :, P.shape[2] - 1]
    p_remove(kind, P, M, X, G, t, arr, 0, n)
    for k in range(n):
        G[TIER_OF, arr[k]] = -1
    M[t, USED] -= n
    M[t, C_EVICTIONS] += n


@njit
def make_room(kind, P, M, X, G, ids, tier, n, guarded):
    """``TierManager._make_room`` with its demotion cascade (``tiercache.core.room``); MADE or
    NO_VICTIMS.

    Victims are chosen top down (a tier's choice changes no other tier): a tier that cannot
    give up enough victims is skipped, its slots untouched, and the victims waiting above it
    try the next tier down; a ``guarded`` placement (a promotion: ``PROT`` marks) is declined
    there instead, NO_VICTIMS with no block moved, and so it is when its cascade would push a
    block out of the last tier while some tier has a free slot (the manager's
    ``_run_holds_the_room``: the run still holds its own slots). Then they are applied bottom
    up in the
    order the recursive Python code completes them: the deepest victims dropped (last tier,
    or no tier below could take them), then each tier's victims moved to their ``DST``.
    """
    T = M.shape[0] - 1
    count = n
    level = tier
    pending = -1  # the deepest tier whose victims have no destination yet
    while level < T:
        need = count - (M[level, CAP] - M[level, USED])
        if need <= 0:
            break
        if guarded and level == T - 1 and level > tier and _free_slots(M) > 0:
            return NO_VICTIMS
        if need > M[level, CAP] or not _victims(kind, P, M, X, G, ids, level, need):
            if level == tier or guarded:
                return NO_VICTIMS
            M[level, VN] = 0  # skipped: the victims above go further down
            level += 1
            continue
        if pending >= 0:
            M[pending, DST] = level
        M[level, VN] = need
        pending = level
        count = need
        level += 1
    if pending < 0:
        return MADE
    if level < T:
        M[pending, DST] = level
        first_move = pending
    else:  # the last tier's victims, or victims no tier below could take, leave
        _drop(kind, P, M, X, G, pending, M[pending, VN])
        first_move = pending - 1
    row = P.shape[2] - 1
    for lev in range(first_move, tier - 1, -1):
        cnt = M[lev, VN]
        if cnt == 0:
            continue
        _hint_future(M, G, P[lev, :, row], 0, cnt)
        _move(kind, P, M, X, G, P[lev, :, row], 0, cnt, lev, M[lev, DST])
        M[lev, C_DEMOTIONS] += cnt
    return MADE


@njit_inline
def _victims(kind, P, M, X, G, ids, t, n):
    """``p_victims`` of tier ``t``; in the last tier, never an id of ``ids[S_KEEP_A:S_KEEP_B]``."""
    T = M.shape[0] - 1
    a = M[T, S_KEEP_A]
    b = M[T, S_KEEP_B] if t == T - 1 else a
    for k in range(a, b):
        G[PROT, ids[k]] += 1
    found = p_victims(kind, P, M, X, G, t, n)
    for k in range(a, b):
        G[PROT, ids[k]] -= 1
    return found


@njit_inline
def _free_slots(M):
    """Free slots of the whole hierarchy."""
    free = 0
    for t in range(M.shape[0] - 1):
        free += M[t, CAP] - M[t, USED]
    return free


@njit_inline
def _room_single(kind, P, M, X, G, n):
    """``make_room(0, n)`` of a one-tier hierarchy (victims leave), inlined: a replay of a
    policy that inserts one block at a time calls it once per miss."""
    need = n - (M[0, CAP] - M[0, USED])
    if need <= 0:
        return MADE
    if need > M[0, CAP] or not p_victims(kind, P, M, X, G, 0, need):
        return NO_VICTIMS
    _drop(kind, P, M, X, G, 0, need)
    return MADE


# -- the access path -------------------------------------------------------------------------
@njit
def _insert_new(kind, P, M, X, G, ids, nus, a, b):
    """``TierManager._insert_new`` with admission always: the chunks of ``_insert_chunks`` (no
    larger than the smallest tier, ``S_GROUP_CAP``), placed in pieces of ``S_CHUNK`` (the
    chunk, or one id for a policy that is not batch-safe); each chunk's transfers and fills
    are counted as one per link (``_count_transfer``)."""
    n = b - a
    if n == 0:
        return
    T = M.shape[0] - 1
    free = M[0, CAP] - M[0, USED]
    step = M[T, S_CHUNK]
    first = max(min(n, free), min(n, step))
    chunk_end = max(min(n, free), min(n, M[T, S_GROUP_CAP]))
    _next_group(M)
    lo = 0
    hi = first
    while lo < n:
        if lo >= chunk_end:
            _next_group(M)
            chunk_end = min(chunk_end + M[T, S_GROUP_CAP], n)
        room = _room_single(kind, P, M, X, G, hi - lo) if T == 1 else make_room(kind, P, M, X, G, ids, 0, hi - lo, False)
        if room == NO_VICTIMS:
            M[0, C_REFUSED] += hi - lo  # everything protected: not stored
        else:
            for k in range(a + lo, a + hi):
                G[TIER_OF, ids[k]] = 0
            M[0, USED] += hi - lo
            _hint_trace(M, G, ids, nus, a + lo, a + hi)
            p_insert(kind, P, M, X, G, 0, ids, a + lo, a + hi)
            M[0, C_INSERTS] += hi - lo
            M[0, C_FILLED] += hi - lo
            _count_transfer(M, 0, C_FILLS, FILL_MARK)
        lo = hi
        hi = min(hi + step, n)
    M[T, S_GROUP] = 0


@njit_inline
def _count_found(M, tier, count, count_hits):
    if count_hits:
        M[tier, C_HITS] += count
    else:
        T = M.shape[0] - 1
        M[T, S_MISSES] += count
        M[T, S_RECOMPUTED] += count


@njit
def _recompute_below(kind, P, M, X, G, ids, nus, a, b, tier):
    """``TierManager._recompute_below``: room is made in the top tier as for a promotion and
    the recomputed segment moves there with no transfer, or stays, touched, when no room
    can be made."""
    n = b - a
    _count_found(M, tier, n, False)
    _hint_trace(M, G, ids, nus, a, b)
    for k in range(a, b):
        G[PROT, ids[k]] += 1
    room = make_room(kind, P, M, X, G, ids, 0, n, True)
    for k in range(a, b):
        G[PROT, ids[k]] -= 1
    _hint_trace(M, G, ids, nus, a, b)
    if room != MADE:
        p_access(kind, P, M, X, G, tier, ids, a, b)
        return
    p_remove(kind, P, M, X, G, tier, ids, a, b)  # first, as ``_move``: kernels may share per-id rows
    for k in range(a, b):
        G[TIER_OF, ids[k]] = 0
    M[tier, USED] -= n
    M[0, USED] += n
    p_insert(kind, P, M, X, G, 0, ids, a, b)
    M[0, C_FILLED] += n
    M[0, C_FILLS] += 1


@njit
def _found_below(kind, P, M, X, G, ids, nus, a, b, tier, count_hits):
    """``TierManager._found_below``: promote the segment, or read it in place (recompute it
    without ``count_hits``)."""
    if not count_hits:
        _recompute_below(kind, P, M, X, G, ids, nus, a, b, tier)
        return
    _hint_trace(M, G, ids, nus, a, b)
    p_access(kind, P, M, X, G, tier, ids, a, b)
    for k in range(a, b):
        G[PROT, ids[k]] += 1  # the whole segment, through every piece
    start = a
    while start < b:
        start = _promote(kind, P, M, X, G, ids, nus, start, b, tier)
    for k in range(a, b):
        G[PROT, ids[k]] -= 1


@njit
def _promote(kind, P, M, X, G, ids, nus, start, b, tier):
    """``TierManager._promote``: ``ids[start:b]`` up in one move, or the first of them (as
    many as there are free slots, when fewer than the run but some), or read in place;
    returns the piece's end."""
    n = b - start
    if n > 1:
        free = _free_slots(M)
        if 0 < free < n:
            n = free
    room = make_room(kind, P, M, X, G, ids, 0, n, True)
    end = start + n
    if room == MADE:
        _hint_trace(M, G, ids, nus, start, end)  # the promotion's plan carries the piece's hints
        _move(kind, P, M, X, G, ids, start, end, tier, 0)
        M[tier, C_PROMOTIONS] += n
        M[tier, C_HIT_PROMOTED] += n
        M[tier, C_HIT_PROMOTE_RUNS] += 1
    else:
        M[tier, C_PSKIP] += n
        M[tier, C_IN_PLACE] += n  # read where it lies: the hit crosses the link to HBM
        M[tier, C_READ_THROUGHS] += 1
    _count_found(M, tier, n, True)
    return end


@njit
def _bring_up(kind, P, M, X, G, ids, nus, a, b, count_hits):
    """``TierManager._bring_up``: a run of distinct ids absent from the top tier."""
    T = M.shape[0] - 1
    if T == 1:
        M[T, S_MISSES] += b - a
        _insert_new(kind, P, M, X, G, ids, nus, a, b)
        return
    pos = a
    while pos < b:
        tier = G[TIER_OF, ids[pos]]
        end = pos + 1
        while end < b and G[TIER_OF, ids[end]] == tier:
            end += 1
        if tier < 0:
            M[T, S_MISSES] += end - pos
            _insert_new(kind, P, M, X, G, ids, nus, pos, end)
        else:
            _found_below(kind, P, M, X, G, ids, nus, pos, end, tier, count_hits)
        pos = end


@njit
def access(kind, P, M, X, G, ids, nus, a, b, count_hits):
    """``TierManager.access(ids[a:b], count_hits=...)`` of a replay (see the module docstring)."""
    T = M.shape[0] - 1
    i = a
    while i < b:
        j = i
        while j < b and G[TIER_OF, ids[j]] == 0:
            j += 1
        if j > i:
            _see_future(M, G, ids, nus, i, j)
            _hint_trace(M, G, ids, nus, i, j)
            p_access(kind, P, M, X, G, 0, ids, i, j)
            if count_hits:
                M[0, C_IN_PLACE] += j - i
                M[0, C_READ_THROUGHS] += 1  # one read to HBM, when the top tier is not HBM
            _count_found(M, 0, j - i, count_hits)
            if j == b:
                break
        k = j + 1
        while k < b and G[TIER_OF, ids[k]] != 0:
            k += 1
        # Cut the run at its first repeated id (it would be a hit the second time).
        M[T, S_EPOCH] += 1
        epoch = M[T, S_EPOCH]
        end = j
        while end < k and G[STAMP, ids[end]] != epoch:
            G[STAMP, ids[end]] = epoch
            end += 1
        _see_future(M, G, ids, nus, j, end)
        _bring_up(kind, P, M, X, G, ids, nus, j, end, count_hits)
        i = end


@njit
def prefix_length(G, ids, a, b):
    """Leading ids of ``ids[a:b]`` resident in some tier."""
    k = a
    while k < b and G[TIER_OF, ids[k]] >= 0:
        k += 1
    return k - a


@njit
def run_requests(kind, P, M, X, G, ids, nus, offsets, r0, r1, prefix, hit_len, caps):
    """Requests ``r0 .. r1 - 1``, each one ``access`` (object semantics) or a prefix lookup
    then two ``access`` calls (prefix semantics, as ``replay``'s prefix step); the prefix
    hit length of request ``r``, at most ``caps[r]`` blocks (``reuse.reusable_blocks``: the
    blocks after them are recomputed whatever the cache holds), goes to ``hit_len[r]``. The cached prefix is never a victim
    of the last tier while it is read (``S_KEEP_A``, ``S_KEEP_B``: the engine pins it), so its
    own promotions push none of it out and each of its ``hit_len[r]`` blocks is a hit."""
    for r in range(r0, r1):
        a = offsets[r]
        b = offsets[r + 1]
        if M[M.shape[0] - 1, S_NEEDS_PARENTS]:
            M[M.shape[0] - 1, S_REQ] = a
        if prefix:
            h = prefix_length(G, ids, a, min(b, a + caps[r]))
            hit_len[r] = h
            M[M.shape[0] - 1, S_KEEP_A] = a  # pinned while served: ``keep_all`` of the manager
            M[M.shape[0] - 1, S_KEEP_B] = a + h
            access(kind, P, M, X, G, ids, nus, a, a + h, True)
            M[M.shape[0] - 1, S_KEEP_B] = a
            access(kind, P, M, X, G, ids, nus, a + h, b, False)
        else:
            access(kind, P, M, X, G, ids, nus, a, b, True)
