"""``TieredLayer``: one model layer of a ``TieredCache`` (``tiercache.integrations.cache``),
the object ``transformers`` calls ``update`` on. It keeps no tensors: it stages the layer's new
K and V for the ``"tiercache"`` attention and answers length queries from its cache. It refers
to its cache weakly, so that a dropped cache is collected (and its rows released) at once, not
at the next cyclic garbage collection."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from tiercache.errors import UserError

if TYPE_CHECKING:
    from .cache import TieredCache

__all__ = ["STAGE", "TieredLayer"]

STAGE = "_tiercache_stage"  # attribute of the key tensor ``update`` returns: (cache, layer)


class TieredLayer(CacheLayerMixin):
    """One model layer of a ``TieredCache``: stages the layer's new K and V for the
    attention and answers length queries from the cache's sequences. Holds no tensors."""

    is_compileable = False
    is_croppable = True  # TieredCache.crop: every row at once
    is_sliding = False

    def __init__(self, owner: "TieredCache", index: int) -> None:
        super().__init__()
        self._owner, self.index = weakref.ref(owner), index

    @property
    def owner(self) -> "TieredCache":
        """The layer's cache (the layer holds it weakly: no reference cycle).

        Raises:
            UserError: the cache was garbage-collected (a layer kept without its cache).
        """
        owner = self._owner()
        if owner is None:
            raise UserError("TieredCache: this layer's cache was garbage-collected (keep the cache, not its layers)")
        return owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Stages the new tokens' K and V (``[batch, kv_heads, t, head_dim]``) for this
        layer's ``"tiercache"`` attention and returns them, tagged for it."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.owner._stage(self.index, key_states, value_states)
        setattr(key_states, STAGE, (self.owner, self.index))
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.owner.seq_length(self.index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:  # the tiers move the blocks; there is nothing to offload
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        self.owner.free()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UserError("TieredCache: rows are reordered for every layer at once (TieredCache.reorder_cache), "
                        "not one layer's")

    def crop(self, tokens_to_remove: int) -> None:
        raise UserError("TieredCache: rows are cropped for every layer at once (TieredCache.crop), not one layer's")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise UserError("TieredCache: batch_repeat_interleave is not supported (generate's num_beams and "
                        "num_return_sequences repeat a held row by themselves)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise UserError("TieredCache: selecting batch rows is not supported")
