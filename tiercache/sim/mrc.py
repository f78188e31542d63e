"""One-pass LRU miss-ratio curves from reuse (stack) distances.

An LRU cache of ``C`` blocks hits an access exactly when fewer than ``C`` distinct other ids
were accessed since the previous access to the same id (Mattson et al., 1970: LRU is a stack
algorithm). So one pass that measures every access's stack distance gives the miss ratio at
every capacity at once, instead of one replay per capacity.

For access ``i`` with previous access ``p`` of the same id, the distinct ids accessed strictly
between them are the positions ``j`` in ``(p, i)`` that are their id's first access after
``p``, i.e. whose own previous access ``prev[j]`` lies before ``p``. Since ``prev[j] < j``,
every ``j < i`` with ``prev[j] > p`` lies inside ``(p, i)``, which gives::

    distinct(p, i) = (i - p - 1) - #{j < i : prev[j] > prev[i]}

With numba (``HAVE_NUMBA``) the distances come from ``stackdist``'s compiled Fenwick-tree
walk instead (the same numbers; ~10x less memory, ~20x less time). Without it, the count on
the right ("earlier elements greater than me") is computed for all accesses at once with
numpy, one stable partition per bit of ``prev`` (a wavelet matrix): O(N log N) work, no
Python loop over accesses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiercache.policies.kernels import HAVE_NUMBA

from . import stackdist
from .traces import next_use

__all__ = ["ReuseHistogram", "previous_access", "stack_distances", "distance_counts", "reuse_histogram",
           "lru_miss_ratio_curve"]


@dataclass(frozen=True)
class ReuseHistogram:
    """Stack distances of a trace, enough to give LRU misses at any capacity.

    Invariants: ``counts[0] == 0``; ``counts[d]`` is the number of re-accesses with stack
    distance ``d`` (1 = the same id as the access just before); ``cold`` counts first
    accesses (infinite distance); ``cold + counts.sum() == accesses``.

    Attributes:
        counts: int64 histogram indexed by stack distance.
        cold: first accesses, which miss at every capacity (the compulsory misses).
        accesses: length of the trace.
    """

    counts: np.ndarray
    cold: int
    accesses: int

    def misses(self, capacities: np.ndarray | list[int]) -> np.ndarray:
        """LRU misses at each capacity (in blocks, each >= 0)."""
        caps = np.asarray(capacities, dtype=np.int64)
        if caps.size and caps.min() < 0:
            raise ValueError(f"capacities must be >= 0, got {caps.min()}")
        # hits_upto[c] = re-accesses with distance <= c: exactly the hits of an LRU of c blocks.
        hits_upto = np.cumsum(self.counts)
        hits = hits_upto[np.minimum(caps, hits_upto.size - 1)]
        return self.accesses - hits

    def miss_ratios(self, capacities: np.ndarray | list[int]) -> np.ndarray:
        """LRU miss ratio at each capacity (1.0 for an empty trace)."""
        misses = self.misses(capacities)
        if self.accesses == 0:
            return np.ones(misses.shape, dtype=np.float64)
        return misses / self.accesses

    @property
    def max_useful_capacity(self) -> int:
        """Smallest capacity that reaches the compulsory floor (all re-accesses hit)."""
        nonzero = np.flatnonzero(self.counts)
        return int(nonzero[-1]) if nonzero.size else 0


def previous_access(ids: np.ndarray) -> np.ndarray:
    """Position of the previous access to the same id, plus one (0 for a first access).

    Shifted by one so the "none" case is 0 rather than a ``-1`` sentinel, which also keeps
    every value a non-negative integer for the bitwise counting below.
    """
    return _previous_from_next(next_use(_flat_ids(ids)))


def _previous_from_next(following: np.ndarray) -> np.ndarray:
    """``previous_access`` from the next-use array ``following`` (``traces.next_use``): an
    entry outside ``[0, N)`` means none, as the compiled walk reads it (``NO_NEXT_USE``, the
    -1 ``stackdist.next_positions`` writes, or that -1 seen through an unsigned type)."""
    following = np.asarray(following, dtype=np.int64)
    reused = np.flatnonzero((following >= 0) & (following < following.size))
    prev_plus_one = np.zeros(following.size, dtype=np.int64)
    prev_plus_one[following[reused]] = reused + 1  # i is the previous access of next_use[i]
    return prev_plus_one


def _earlier_greater(values: np.ndarray) -> np.ndarray:
    """For every ``i``, how many ``j < i`` have ``values[j] > values[i]`` (values >= 0).

    Wavelet-matrix counting: bits are visited from the most significant down. Before the
    visit of bit ``b`` the elements are ordered so that equal higher bits (the "prefix") are
    contiguous and, inside a prefix group, still in original order. Within a group, an earlier
    element is greater than ``i`` at this bit exactly when its bit ``b`` is 1 and ``i``'s is 0;
    pairs that differ at a higher bit were counted at that bit. A stable partition on bit
    ``b`` then keeps the invariant for the next bit. Each bit costs O(N) numpy work.

    Memory: the arrays are int32 while ``N`` and the values fit (about 30 B per element at
    the peak), and the ones before each group's start come from a running maximum (the
    exclusive count of ones never decreases), not from an index array and a gather.
    """
    n = values.size
    counts = np.zeros(n, dtype=np.int64)
    if n < 2:
        return counts
    top = int(values.max())
    narrow = np.int32 if max(n, top) < np.iinfo(np.int32).max else np.int64
    order = np.arange(n, dtype=narrow)
    current = values.astype(narrow)
    for bit in reversed(range(top.bit_length())):
        prefix = current >> (bit + 1)
        group_start = np.empty(n, dtype=bool)
        group_start[0] = True
        np.not_equal(prefix[1:], prefix[:-1], out=group_start[1:])
        del prefix
        ones = (current >> bit) & 1
        in_group = np.cumsum(ones, dtype=narrow)
        in_group -= ones  # ones strictly before, in the whole array
        at_start = np.where(group_start, in_group, 0)
        del group_start
        in_group -= np.maximum.accumulate(at_start, out=at_start)  # ... and in the group only
        del at_start
        zero = ones == 0
        del ones
        counts[order[zero]] += in_group[zero]
        del in_group
        order = np.concatenate((order[zero], order[~zero]))
        current = np.concatenate((current[zero], current[~zero]))
    return counts


def _wavelet_distances(prev_plus_one: np.ndarray) -> np.ndarray:
    """``stack_distances`` from ``previous_access``'s array, with numpy (no numba)."""
    distances = np.arange(1, prev_plus_one.size + 1, dtype=np.int64)
    # i + 1 - prev_plus_one - greater = distinct(p, i) + 1, with p = prev_plus_one - 1 (module docstring).
    distances -= prev_plus_one
    distances -= _earlier_greater(prev_plus_one)
    distances[prev_plus_one == 0] = 0
    return distances


def _flat_ids(ids, name: str = "ids") -> np.ndarray:
    """``ids`` as an int64 array, which must be 1-D and of integers (bool included; uint64
    ids at or above 2**63 wrap, one to one), ValueError otherwise: the compiled and the numpy
    paths then refuse the same input the same way, and a float id is never truncated into
    another one."""
    given = np.asarray(ids)
    if given.dtype.kind not in "iub" and given.size:
        raise ValueError(f"{name} must be integers, got dtype {given.dtype}")
    if given.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {given.shape}")
    return given.astype(np.int64, copy=False)


def stack_distances(ids: np.ndarray) -> np.ndarray:
    """LRU stack distance of every access (0 for a first access, which never hits).

    Distance ``d >= 1`` means the access hits in an LRU cache of ``d`` or more blocks.

    Args:
        ids: int64 array of block ids in access order.
    """
    ids = _flat_ids(ids)
    if HAVE_NUMBA:
        return stackdist.walk_distances(stackdist.next_positions(ids))
    return _wavelet_distances(previous_access(ids))


def distance_counts(ids: np.ndarray, touched: np.ndarray | None = None,
                    following: np.ndarray | None = None) -> np.ndarray:
    """Histogram of the stack distances of the accesses where ``touched`` (all when None).

    Equal to ``np.bincount(stack_distances(ids)[touched], minlength=1)`` (int64; ``counts[0]``
    counts first accesses, and the last entry is nonzero unless the histogram is ``[0]``),
    but with numba no per-access distance is kept: the walk adds each one up as it goes.

    Args:
        ids: int64 array of block ids in access order.
        touched: bool mask of the accesses to count (one per access), or None for all of them.
        following: ``traces.next_use(ids)`` when the caller has it already (saves a sort);
            -1 also means "no next access", as ``stackdist.next_positions`` writes it. It is
            trusted, not checked: only its shape is, and the compiled walk refuses one that
            would make it count past its array (a guard for memory, not a validation).
    """
    ids = _flat_ids(ids)
    for name, given in (("touched", touched), ("following", following)):
        if given is not None and np.shape(given) != ids.shape:
            raise ValueError(f"distance_counts: {name} has shape {np.shape(given)}, the ids {ids.shape}")
    touched = None if touched is None else np.asarray(touched, dtype=bool)
    following = None if following is None else _flat_ids(following, "distance_counts: following")
    if HAVE_NUMBA:
        return stackdist.walk_counts(stackdist.next_positions(ids) if following is None else following, touched)
    distances = _wavelet_distances(previous_access(ids) if following is None else _previous_from_next(following))
    return np.bincount(distances if touched is None else distances[touched],
                       minlength=1).astype(np.int64)


def reuse_histogram(ids: np.ndarray) -> ReuseHistogram:
    """Histogram of the stack distances of ``ids`` (int64 array, access order)."""
    counts = distance_counts(ids)
    cold = int(counts[0])
    counts[0] = 0
    return ReuseHistogram(counts=counts, cold=cold, accesses=int(np.asarray(ids).size))


def lru_miss_ratio_curve(ids: np.ndarray, capacities: np.ndarray | list[int]) -> tuple[np.ndarray, ReuseHistogram]:
    """LRU miss ratios at ``capacities`` (blocks) from one pass over ``ids``.

    Returns:
        The miss ratio at each capacity (float64, same order), and the full histogram so
        more capacities can be read off without another pass.
    """
    histogram = reuse_histogram(ids)
    return histogram.miss_ratios(capacities), histogram
