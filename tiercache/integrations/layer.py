"""``TieredLayer``: one model layer of a ``TieredCache`` (``tiercache.integrations.cache``),
the object ``transformers`` calls ``update`` on. It keeps no tensors: it stages the layer's new
K and V for the ``"tiercache"`` attention and answers length queries from its cache. It refers
to its cache weakly, so that a dropped cache is collected (and its rows released) at once, not
at the next cyclic garbage collection.

The key ``update`` returns is tagged (``STAGE``) with its cache and layer: the attention finds
the cache by it. A key that lost the tag (a model that transforms K after the update) is told
apart from a pass without a ``TieredCache`` by ``unread_stage``: the layer this thread staged
last, while no attention has read it."""

from __future__ import annotations

from tiercache.extras import require

require("torch", "transformers", what="tiercache.integrations (the transformers cache)")

import threading
import weakref
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from tiercache.errors import UserError

if TYPE_CHECKING:
    from .cache import TieredCache

__all__ = ["STAGE", "TieredLayer", "forget_stage", "unread_stage"]

STAGE = "_tiercache_stage"  # attribute of the key tensor ``update`` returns: (cache, layer)
_LAST = threading.local()  # .stage: (weak ref to the cache, layer) of this thread's last update


def forget_stage() -> None:
    """Forgets this thread's last staged layer (a decoder pass begins: what an earlier pass
    left unread is not this pass's)."""
    _LAST.stage = None


def unread_stage() -> "tuple[TieredCache, int] | None":
    """The (cache, layer) this thread's last ``update`` staged, while its K and V are still
    unread by the attention; None when there is none (no ``TieredCache`` in this pass)."""
    last = getattr(_LAST, "stage", None)
    cache = None if last is None else last[0]()
    if cache is None or cache.layers[last[1]].staged() is None:
        return None
    return cache, last[1]


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

    def __deepcopy__(self, memo: dict) -> "TieredLayer":
        """Refused: a layer is a view of its cache's rows, so a copy would stage into the same
        layer again (a looped model such as Dory copies a layer's cache once per loop: its
        second loop then attended over the first loop's KV as its own). ``copy.deepcopy``
        of the whole ``TieredCache`` makes a second cache.

        Raises:
            UserError: always; nothing is staged or stored.
        """
        raise UserError(f"TieredCache: the model copied layer {self.index} of its cache on its own (a looped model, "
                        "such as Dory, giving each loop a copy of a layer's cache); a TieredCache layer is a view of "
                        "its TieredKVCache's rows and cannot be copied alone, so this model is not supported; "
                        "nothing was stored")

    def __copy__(self) -> "TieredLayer":
        """Refused as ``__deepcopy__`` (a shallow copy stages into the same layer too)."""
        return self.__deepcopy__({})

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Stages the new tokens' K and V (``[batch, kv_heads, t, head_dim]``) for this
        layer's ``"tiercache"`` attention and returns them, the key tagged for it.

        Raises:
            UserError: K or V is not of the layout's shape (nothing is staged).
        """
        owner = self.owner
        self._check_shape(owner, key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner._stage(self.index, key_states, value_states)
        setattr(key_states, STAGE, (owner, self.index))
        _LAST.stage = (self._owner, self.index)
        return key_states, value_states

    def staged(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (K, V) this layer staged in the running pass that no attention has read yet."""
        return self.owner._staged[self.index]

    def _check_shape(self, owner: "TieredCache", key: torch.Tensor, value: torch.Tensor) -> None:
        """Raises UserError unless K and V are both ``[batch, kv_heads, t, head_dim]`` of the
        cache's layout (a layout that is not the model's: a config field the model ignores)."""
        layout = owner.kv.layout
        want = (layout.kv_heads, layout.head_dim)
        if key.dim() == 4 and value.shape == key.shape and (key.shape[1], key.shape[3]) == want:
            return
        raise UserError(f"TieredCache: layer {self.index} gives K of shape {tuple(key.shape)} and V of shape "
                        f"{tuple(value.shape)}, but the TieredKVCache stores both as [batch, kv_heads={want[0]}, "
                        f"tokens, head_dim={want[1]}] (its layout, kv_layout(model.config), is not what the model "
                        "computes: check the config's num_key_value_heads, head_dim and v_head_dim); nothing was "
                        "stored")

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
