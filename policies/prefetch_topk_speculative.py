"""Prefetch ``topk_speculative``: speculate the next step's sparse selection from this one's.

Consecutive decode queries are similar, so the blocks a sparse step selects change little
from one step to the next (the observation behind InfiniGen's and ShadowKV's speculative
fetching). The step's own selection is promoted by the read itself; what the next step is
likeliest to add are the blocks ranked just below this step's cut. This policy brings those
candidates up now, a step early, so the next step can find its newcomers already in the
top tier. Like ``layer_ahead`` it also brings up the next layer's first reads.

It pays only where the top tier has room beyond what a step reads: with HBM barely holding
the sparse budget, the candidates are pushed back down before the next step reads them
(counted as ``prefetch_wasted``) and their copies only add link time (a 5-block HBM under a
4-block budget: 18 prefetched, 12 wasted, modeled time +19% against ``--prefetch none``).
"""

from __future__ import annotations

from .base import PrefetchPolicy, PrefetchView


class TopKSpeculative(PrefetchPolicy):
    """Plans the ranked candidates not in the top tier, best first, then ``view.ahead``.

    The step's own reads are not planned: a sparse read promotes them itself, and an exact
    read streams the whole sequence in place, which a prefetch must not undo.
    """

    name = "topk_speculative"

    def plan(self, view: PrefetchView) -> list[int]:
        return self._cap([*view.candidates, *view.ahead], view)
