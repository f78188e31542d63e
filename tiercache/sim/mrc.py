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

The count on the right ("earlier elements greater than me") is computed for all accesses at
once with numpy, one stable partition per bit of ``prev`` (a wavelet matrix): O(N log N)
work, no Python loop over accesses. Metadata plane: numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiercache.policies.base import NO_NEXT_USE

from .traces import next_use

__all__ = ["ReuseHistogram", "previous_access", "stack_distances", "reuse_histogram", "lru_miss_ratio_curve"]


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
    ids = np.asarray(ids, dtype=np.int64)
    following = next_use(ids)
    reused = np.flatnonzero(following != NO_NEXT_USE)
    prev_plus_one = np.zeros(ids.size, dtype=np.int64)
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
    """
    n = values.size
    counts = np.zeros(n, dtype=np.int64)
    if n < 2:
        return counts
    order = np.arange(n)
    current = values.astype(np.int64, copy=True)
    index = np.arange(n)
    for bit in reversed(range(int(current.max()).bit_length())):
        ones = (current >> bit) & 1
        prefix = current >> (bit + 1)
        group_start = np.zeros(n, dtype=bool)
        group_start[0] = True
        group_start[1:] = prefix[1:] != prefix[:-1]
        ones_before = np.cumsum(ones) - ones
        first_of_group = np.maximum.accumulate(np.where(group_start, index, 0))
        ones_before_in_group = ones_before - ones_before[first_of_group]
        zero = ones == 0
        counts[order[zero]] += ones_before_in_group[zero]
        order = np.concatenate((order[zero], order[~zero]))
        current = np.concatenate((current[zero], current[~zero]))
    return counts


def stack_distances(ids: np.ndarray) -> np.ndarray:
    """LRU stack distance of every access (0 for a first access, which never hits).

    Distance ``d >= 1`` means the access hits in an LRU cache of ``d`` or more blocks.

    Args:
        ids: int64 array of block ids in access order.
    """
    prev_plus_one = previous_access(ids)
    greater = _earlier_greater(prev_plus_one)
    positions = np.arange(prev_plus_one.size, dtype=np.int64)
    # distinct(p, i) + 1, with p = prev_plus_one - 1; see the module docstring.
    distances = positions - prev_plus_one - greater + 1
    distances[prev_plus_one == 0] = 0
    return distances


def reuse_histogram(ids: np.ndarray) -> ReuseHistogram:
    """Histogram of the stack distances of ``ids`` (int64 array, access order)."""
    distances = stack_distances(ids)
    counts = np.bincount(distances, minlength=1).astype(np.int64)
    cold = int(counts[0])
    counts[0] = 0
    return ReuseHistogram(counts=counts, cold=cold, accesses=int(distances.size))


def lru_miss_ratio_curve(ids: np.ndarray, capacities: np.ndarray | list[int]) -> tuple[np.ndarray, ReuseHistogram]:
    """LRU miss ratios at ``capacities`` (blocks) from one pass over ``ids``.

    Returns:
        The miss ratio at each capacity (float64, same order), and the full histogram so
        more capacities can be read off without another pass.
    """
    histogram = reuse_histogram(ids)
    return histogram.miss_ratios(capacities), histogram
