"""Prefetch ``layer_ahead``: while layer l computes, bring up what layer l+1 reads first.

A decode step runs the layers in order, so the moment layer l's attention starts is the
earliest point at which layer l+1's reads are known (in exact mode: its first chunks; in
sparse mode: its sink and recent blocks, which every selection keeps). The classic
layer-wise pipelining of offloading systems (FlexGen, vLLM's and SGLang's layer-wise
loading): the copy of layer l+1's KV overlaps layer l's compute.
"""

from __future__ import annotations

from .base import PrefetchPolicy, PrefetchView


class LayerAhead(PrefetchPolicy):
    """Plans ``view.ahead`` (the next layer's first reads) that are not in the top tier."""

    name = "layer_ahead"

    def plan(self, view: PrefetchView) -> list[int]:
        return self._cap(view.ahead, view)
