"""cost: cost-aware eviction for prefix caches (GreedyDual-Size-Frequency over prefix-tree leaves)."""

from __future__ import annotations

from typing import Sequence

from ._checks import require_tracked
from ._leafprio import LeafPriorityPolicy

#: Prefix depth, in blocks, at which recomputing a block costs twice a root block's work.
DEFAULT_DEPTH_SCALE = 64.0


class CostAware(LeafPriorityPolicy):
    """Evicts the leaf whose recompute saved per byte, weighed with recency, is lowest.

    Recomputing block ``d`` of a prefix (0-based depth) costs its linear work (projections and
    MLP, the same at every depth) plus attention over the ``d`` blocks before it, which grows
    with ``d``; so a deep block costs more than a shallow one: ``cost(d) = 1 + d / depth_scale``
    (``depth_scale`` is the depth at which attention equals the linear work: about 30k tokens
    for an 8B model, i.e. 64 blocks of 512 tokens, the default). Blocks are equal in size, so
    value per byte is value per block.

    Key (lowest evicted first, leaves only): GreedyDual-Size-Frequency,
    ``key = L + uses x cost(depth)``, where ``L`` is the key of the last block evicted. ``L``
    only grows, so a block that is not used again ages out behind newly touched ones: that is
    the recency half. Depth is the block's distance from its root in the tracked tree (a block
    whose parent is not tracked counts as a root).

    Sources and departures: GDSF (Cherkasova 1998; Cao and Irani's GreedyDual-Size) with the
    recompute cost of a prefix block in the role of the fetch cost, as in "Cost-Efficient LLM
    Serving" style cost models and LPC's per-block recompute value. Departures: sizes are equal
    (no size term); only prefix-tree leaves are candidates (a parent is never evicted before
    its children, see :class:`LeafPriorityPolicy`); use counts are forgotten on eviction.

    Invariants: those of :class:`LeafPriorityPolicy`; ``_uses`` and ``_depth`` hold exactly
    the tracked ids; ``_inflation`` never decreases.
    """

    name = "cost"

    def __init__(self, capacity: int, depth_scale: float = DEFAULT_DEPTH_SCALE) -> None:
        super().__init__(capacity)
        if depth_scale <= 0:
            raise ValueError(f"cost: depth_scale must be > 0, got {depth_scale}")
        self._scale = depth_scale
        self._uses: dict[int, int] = {}
        self._depth: dict[int, int] = {}
        self._inflation = 0.0

    def recompute_cost(self, depth: int) -> float:
        """Relative cost of recomputing a block at prefix depth ``depth`` (root: 1)."""
        return 1.0 + depth / self._scale

    def _key_after(self, block_id: int, parent: int | None, inserted: bool) -> float:
        if inserted:
            self._depth[block_id] = self._depth[parent] + 1 if parent in self._depth else 0
        uses = self._uses.get(block_id, 0) + 1
        self._uses[block_id] = uses
        return self._inflation + uses * self.recompute_cost(self._depth[block_id])

    def on_remove(self, ids: Sequence[int]) -> None:
        require_tracked(self.name, ids, self._parent, distinct=True)  # misuse changes nothing
        for block_id in ids:
            self._inflation = max(self._inflation, self._key[block_id])
        super().on_remove(ids)

    def _forget(self, block_id: int) -> None:
        del self._uses[block_id]
        del self._depth[block_id]

    def check_invariants(self) -> None:
        super().check_invariants()
        assert self._uses.keys() == self._parent.keys() == self._depth.keys(), "per-block state != tracked ids"
