"""What a live store's lookups answered: the prefix-cache hit ratio a serving engine reports.

A serving engine asks the store which leading blocks of a prompt it holds (``match_prefix``,
``lookup``), reuses those and computes the rest: that answer, not the reads that follow it,
is its prefix-cache hit ratio (vLLM's prefix-cache stats count the tokens queried and hit the
same way, once per request). The store's ``hits`` and ``misses`` count reads instead
(``Traffic``): a loop that reads only what a lookup found sees no misses there.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LookupCounts"]


@dataclass
class LookupCounts:
    """Blocks asked about by the store's lookups, in total.

    ``calls``: lookups answered. ``hits``: blocks of the stored prefix they found (a prefix
    cache reuses nothing past the first block it lacks). ``misses``: the blocks asked about
    past that prefix, stored or not.

    Invariants: every count is non-negative; ``hits + misses`` is the number of blocks asked
    about; one call is counted once (``match_prefix``'s own lookup is not counted apart).
    """

    calls: int = 0
    hits: int = 0
    misses: int = 0

    def count(self, asked: int, found: int) -> None:
        """Counts one lookup of ``asked`` blocks whose first ``found`` are stored."""
        if not 0 <= found <= asked:
            raise ValueError(f"a lookup found {found} of {asked} blocks")
        self.calls += 1
        self.hits += found
        self.misses += asked - found

    def as_dict(self) -> dict[str, int]:
        """Plain dict for ``stats()``."""
        return {"calls": self.calls, "hits": self.hits, "misses": self.misses}
