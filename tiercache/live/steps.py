"""What one ``Sequence.attend`` read, for the per-step table: ``StepReport`` and
``step_report``, which builds it from the read's ``ReadTicket`` (``tiercache.core.decode``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiercache.config import AttentionMode
from tiercache.core.decode import ReadTicket

if TYPE_CHECKING:
    from .cache import TieredKVCache

__all__ = ["StepReport", "step_report"]


@dataclass(frozen=True)
class StepReport:
    """What one ``attend`` read, for the per-step table.

    Attributes:
        step, layer, mode: which attention call.
        selected: blocks read from the tiers (every full block in exact mode).
        hbm_hits: of those, blocks found in HBM.
        from_dram, from_nvme: blocks found in DRAM / on NVMe (promoted, or read in place).
        prefetched: blocks whose moves to HBM the step started for later steps.
        bytes_moved: bytes of the blocks read from lower tiers (as each tier stores them:
            a quantised tier's encoded bytes) plus the prefetched ones (at HBM's size).
        tail_tokens: tokens of the partial tail block (read from the sequence, no tier).
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


def step_report(cache: TieredKVCache, layer: int, step: int, mode: AttentionMode, ticket: ReadTicket | None,
                selected: int, tail: int) -> StepReport:
    """The report of one read of ``selected`` blocks of ``cache`` (``ticket`` None: no block
    was read, only the ``tail`` tokens)."""
    found = ticket.found if ticket is not None else [0] * cache.manager.n_tiers
    count = {d.name: found[t] for t, d in enumerate(cache.manager.dirs)}
    prefetched = ticket.prefetched if ticket is not None else 0
    size = cache.store.tier_block_bytes
    moved = sum(found[t] * size[t] for t in range(1, len(found))) + prefetched * size[0]
    return StepReport(step, layer, mode, selected, count.get("hbm", 0), count.get("dram", 0), count.get("nvme", 0),
                      prefetched, moved, tail)
