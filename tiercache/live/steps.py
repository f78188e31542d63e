"""What one ``Sequence.attend`` read, for the per-step table: ``StepReport``, ``step_report``,
which builds it from the read's ``ReadTicket`` (``tiercache.core.decode``), and
``StepReports``, the bounded list of a sequence's latest reports (``Sequence.reports``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiercache.config import AttentionMode
from tiercache.core.decode import ReadTicket

from .traffic import link_block_bytes

if TYPE_CHECKING:
    from .cache import TieredKVCache

__all__ = ["StepReport", "StepReports", "step_report"]


@dataclass(frozen=True)
class StepReport:
    """What one ``attend`` read, for the per-step table.

    Attributes:
        step, layer, mode: which attention call.
        selected: blocks read from the tiers (every full block in exact mode).
        hbm_hits: of those, blocks found in HBM.
        from_dram, from_nvme: blocks found in DRAM / on NVMe (promoted, or read in place).
        prefetched: blocks whose moves to HBM the step started for later steps.
        bytes_moved: bytes the step brought into HBM: the blocks read from lower tiers
            (promoted or read in place) and the prefetched ones, each at what one block
            brings over its link to HBM, the rule of ``stats()["bytes_moved"]``
            (``traffic.link_block_bytes``: a quantised tier's encoded bytes only where they
            are what crosses). The moves down that made room for them are not in it.
        tail_tokens: tokens of the partial tail block (read from the sequence, no tier).

    Invariants: over a run of steps, the reports' ``bytes_moved`` sum to the growth of
    ``stats()["bytes_moved"]`` on the links into HBM, quantised tiers included (appends between
    them bring nothing into HBM; a store ``get`` would; a prefetch counts when it starts).
    """

    step: int
    layer: int
    mode: AttentionMode
    selected: int
    hbm_hits: int
    from_dram: int
    from_nvme: int
    prefetched: int
    bytes_moved: int
    tail_tokens: int


class StepReports(list):
    """A sequence's ``StepReport`` of its latest reads, oldest first: a ``list`` (index, slice,
    iterate, copy, compare, concatenate as the list it replaced) whose ``append`` trims it.

    Invariants: after ``n`` appends it holds the latest ``min(n, keep)`` reports at least and
    ``2 * keep`` at most (``keep`` 0: none); an append that would make it longer than
    ``2 * keep`` first drops the oldest, down to the latest ``keep``, so appending is amortised
    O(1) and a decode of any length keeps bounded memory (a report takes about 200 bytes).
    Reading is a list's: iterating it while the decode thread appends never raises (it may
    miss reports dropped meanwhile), and ``list()``, ``copy.copy``, slices are snapshots. Only
    ``append`` is bounded; the other list methods are the caller's to use.
    """

    def __init__(self, keep: int) -> None:
        super().__init__()
        self.keep = keep

    def append(self, report: StepReport) -> None:
        """Adds the report of the latest read, dropping the oldest (keeping the latest ``keep``)
        when the list would exceed ``2 * keep``."""
        if self.keep == 0:
            return
        if len(self) >= 2 * self.keep:
            del self[: len(self) - self.keep + 1]
        super().append(report)


def step_report(cache: TieredKVCache, layer: int, step: int, mode: AttentionMode, ticket: ReadTicket | None,
                selected: int, tail: int) -> StepReport:
    """The report of one read of ``selected`` blocks of ``cache`` (``ticket`` None: no block
    was read, only the ``tail`` tokens)."""
    found = ticket.found if ticket is not None else [0] * cache.manager.n_tiers
    count = {d.name: found[t] for t, d in enumerate(cache.manager.dirs)}
    prefetched = ticket.prefetched if ticket is not None else 0
    moved = _bytes_into_hbm(cache, ticket) if ticket is not None else 0
    return StepReport(step, layer, mode, selected, count.get("hbm", 0), count.get("dram", 0), count.get("nvme", 0),
                      prefetched, moved, tail)


def _bytes_into_hbm(cache: TieredKVCache, ticket: ReadTicket) -> int:
    """Bytes ``ticket``'s read brought into HBM (tier 0): each block found below it crosses its
    tier's link to HBM (promoted, or read in place), each prefetched one its plan's link, at
    ``link_block_bytes`` of the store's tiers, as ``Traffic.link_bytes`` charges them."""
    names = [d.name for d in cache.manager.dirs]
    sizes, quantised = cache.store.tier_block_bytes, cache.store.tier_quantised
    read = sum(n * link_block_bytes(names, sizes, quantised, tier, 0) for tier, n in enumerate(ticket.found) if tier and n)
    ahead = sum(p.n_blocks * link_block_bytes(names, sizes, quantised, p.src_tier, p.dst_tier) for p in ticket.plans)
    return read + ahead
