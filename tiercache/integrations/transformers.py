"""A drop-in ``transformers`` cache over tiercache's tiers, and the attention that reads it.

``TieredCache`` is a ``transformers`` ``Cache`` whose layers keep no tensors: every token's
KV goes into a ``TieredKVCache`` sequence per batch row (HBM, then DRAM and NVMe as the
policies decide), and the ``"tiercache"`` attention implementation reads it back from
wherever it lies, chunk by chunk through a bounded window (``Sequence.attend_partial``).
A model's KV is therefore bounded by the tiers, not by its device memory::

    from tiercache.integrations.transformers import TieredCache, kv_layout, use_tiercache

    use_tiercache(model)                             # attn_implementation="tiercache"
    kv = TieredKVCache(kv_layout(model.config, torch.float32, block_tokens=16), tiers, device="cpu")
    cache = TieredCache(kv, model.config, prompt=input_ids)   # reuses the stored prefix
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=32)
    cache.free()                                     # blocks stay stored for the next prompt

How a forward pass goes through it: the model's attention calls ``cache.update`` with the
new tokens' K and V; the layer stages them (nothing is stored yet) and returns them
tagged; the ``"tiercache"`` attention then computes, for each batch row, attention over the
tokens the sequence already holds (every query sees all of them) merged by log-sum-exp
with causal attention over the new tokens, and only then appends the new tokens. A decode
step (one new token) appends first and reads once, in the cache's ``mode``
(``AttentionMode.SPARSE`` reads only the top blocks, as ``Sequence.attend``); a prefill
chunk over a stored prefix is always exact.

``use_tiercache`` also registers a forward pre-hook that hands each pass's ``input_ids`` to
the cache, so the blocks generated tokens fill get content keys (a chat's next turn finds the
whole conversation so far); a pass without ids (``inputs_embeds``) leaves later blocks private.

Invariants: between forward passes every row has passed the same positions at every layer
(its tokens of KV plus its unstored left padding); a staged update is consumed by the attention of the same layer before the
next update of that layer (else the model's attention is not ``"tiercache"`` and the
cache raises rather than return attention over the new tokens alone).

Batches: each row is its own sequence. A row's left padding (0 in the 2-D attention mask the
pre-hook sees) is not stored: ``seq_length()`` counts it (transformers' positions), the row's
sequence holds only its tokens, and the attention gives padding queries a zero output.

Limits (each raises ``UserError`` naming it): padding after a token or any other mask than
causal-after-left-padding, beam search, crop or batch reordering, attention dropout,
soft-capping or sliding window.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tiercache.attention import Partial, compute_dtype, merge
from tiercache.config import AttentionMode, KVLayout
from tiercache.data.buffers import torch_dtype
from tiercache.errors import UserError
from tiercache.live.arguments import flat_token_ids
from tiercache.live.cache import TieredKVCache
from tiercache.live.sequence import Sequence

from .causal import causal_partial, expected_mask

__all__ = ["ATTENTION", "TieredCache", "kv_layout", "use_tiercache", "tiercache_attention"]

#: The ``attn_implementation`` name this module registers.
ATTENTION = "tiercache"
_STAGE = "_tiercache_stage"  # attribute of the key tensor ``update`` returns: (cache, layer)
_HOOKED = "_tiercache_token_hook"  # set on a model once use_tiercache has hooked it
_CACHE_KWARGS = ("cache", "past_key_values")  # the cache's keyword, in transformers 5 and before


def kv_layout(config: Any, dtype: torch.dtype, block_tokens: int = 256) -> KVLayout:
    """The per-layer KV layout of a ``transformers`` decoder config (layers, KV heads,
    head size) with KV stored as ``dtype``.

    Raises:
        UserError: the config lacks a field or ``dtype`` is not a dtype tiercache stores.
    """
    try:
        layers, heads = config.num_hidden_layers, config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    except AttributeError as exc:
        raise UserError(f"kv_layout: the config has no {exc.name!r}: not a decoder config tiercache knows") from None
    name = str(dtype).removeprefix("torch.")
    try:
        return KVLayout(layers, kv_heads, head_dim, name, block_tokens, per_layer=True, name=config.model_type)
    except Exception as exc:  # ConfigError: name the argument that was wrong
        raise UserError(f"kv_layout: {exc}") from None


def use_tiercache(model: Any) -> Any:
    """Switches ``model`` (a ``transformers`` model) to the ``"tiercache"`` attention
    implementation, which a ``TieredCache`` needs, and lets a ``TieredCache`` see the token
    ids of each forward pass (a pre-hook), so that generated tokens' blocks get content keys
    too; returns the model. Idempotent."""
    register()
    model.set_attn_implementation(ATTENTION)
    if model.config._attn_implementation != ATTENTION:
        raise UserError(f"use_tiercache: {type(model).__name__} cannot switch its attention implementation "
                        "(it does not use transformers' AttentionInterface)")
    if not getattr(model, _HOOKED, False):
        model.register_forward_pre_hook(_see_token_ids, with_kwargs=True)
        setattr(model, _HOOKED, True)
    return model


def _see_token_ids(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: hands the pass's ``input_ids`` to the ``TieredCache`` it runs with."""
    cache = next((kwargs[name] for name in _CACHE_KWARGS if isinstance(kwargs.get(name), TieredCache)), None)
    ids = kwargs.get("input_ids", args[0] if args else None)
    if cache is not None and isinstance(ids, torch.Tensor):
        cache._see_tokens(ids, kwargs.get("attention_mask"))


def register() -> None:
    """Registers the ``"tiercache"`` attention and its mask (transformers' boolean SDPA mask,
    or none for a plain causal batch) with ``transformers``. Idempotent."""
    AttentionInterface.register(ATTENTION, tiercache_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


class TieredLayer(CacheLayerMixin):
    """One model layer of a ``TieredCache``: stages the layer's new K and V for the
    attention and answers length queries from the cache's sequences. Holds no tensors."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: "TieredCache", index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Stages the new tokens' K and V (``[batch, kv_heads, t, head_dim]``) for this
        layer's ``"tiercache"`` attention and returns them, tagged for it."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.owner._stage(self.index, key_states, value_states)
        setattr(key_states, _STAGE, (self.owner, self.index))
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
        raise UserError("TieredCache: beam search (reorder_cache) is not supported; use greedy or sampling")

    def crop(self, tokens_to_remove: int) -> None:
        raise UserError("TieredCache: crop is not supported (stored blocks are not cut back)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise UserError("TieredCache: expanding the batch (num_return_sequences, beams) is not supported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise UserError("TieredCache: selecting batch rows is not supported")


class TieredCache(Cache):
    """A ``transformers`` cache whose KV lives in a ``TieredKVCache``.

    Args:
        kv: the tiered cache (its layout must match the model: ``kv_layout``).
        config: the model's config; its attention implementation must be ``"tiercache"``
            (``use_tiercache(model)``).
        mode: attention of decode steps: ``AttentionMode.EXACT`` or ``SPARSE``.
        budget: sparse only: blocks each decode step reads (``Sequence.attend``'s budget).
        prompt: the prompt's token ids (``[batch, n]``): each row starts from the longest
            prefix that every row has stored (whole blocks, at least one token left to
            compute), and the prompt's blocks get content keys a later prompt finds. Pass
            the same ids to ``generate``: it computes only from ``get_seq_length()`` on.
        attention_mask: the prompt's ``[batch, n]`` mask (0: left padding), as given to
            ``generate``: padding ids are not tokens of the row; a padded batch reuses no
            stored prefix (its rows would start at different positions).
        namespace: keeps prefixes of different models or adapters apart.

    Raises:
        UserError: the model's attention is not ``"tiercache"``; the layout does not match
            the config; a bad mode, budget or prompt.
    """

    def __init__(self, kv: TieredKVCache, config: Any, mode: AttentionMode = AttentionMode.EXACT,
                 budget: float | int | None = None, prompt=None, attention_mask=None,
                 namespace: bytes | str = b"") -> None:
        _check_config(kv, config)
        if not isinstance(mode, AttentionMode):
            raise UserError(f"TieredCache: mode must be an AttentionMode (EXACT or SPARSE), got {mode!r}")
        if (mode is AttentionMode.SPARSE) != (budget is not None):
            raise UserError("TieredCache: a budget is given with AttentionMode.SPARSE, and only with it")
        super().__init__(layers=[TieredLayer(self, layer) for layer in range(kv.layout.layers)])
        self.kv, self.mode, self.budget, self.namespace = kv, mode, budget, namespace
        self.sequences: list[Sequence] = []
        self._staged: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * kv.layout.layers
        self._checked_mask: torch.Tensor | None = None  # the last mask found as expected (identity)
        self._pads = np.zeros((kv.layout.layers, 0), dtype=np.int64)  # [layer, row]: padding not stored
        self._pass: tuple[int, torch.Tensor] | None = None  # (start, kept columns [batch, t]) of a padded pass
        if prompt is not None:
            self._start(prompt, attention_mask)
        elif attention_mask is not None:
            raise UserError("TieredCache: attention_mask is the prompt's mask: give it with prompt=")

    # -- public -------------------------------------------------------------------------
    @property
    def cached_tokens(self) -> int:
        """Prompt tokens each row reused from the tiers (0 without a prompt)."""
        return self.sequences[0].cached_tokens if self.sequences else 0

    def seq_length(self, layer: int = 0) -> int:
        """Positions every row has passed at ``layer``: its tokens of KV plus the left padding
        it did not store (0 before the first forward)."""
        return self.sequences[0].length(layer) + int(self._pads[layer, 0]) if self.sequences else 0

    def free(self) -> None:
        """Releases every row's blocks (they stay stored for a later prompt's prefix until
        the policies evict them); the cache starts empty again. Idempotent."""
        for seq in self.sequences:
            seq.free()
        self.sequences = []
        self._staged = [None] * len(self._staged)
        self._pads = np.zeros((len(self._staged), 0), dtype=np.int64)
        self._pass = None

    # -- the forward pass ---------------------------------------------------------------
    def _open(self, rows: int) -> None:
        """Empty sequences for a batch of ``rows`` (no prompt given)."""
        self.sequences = [self.kv.sequence(namespace=self.namespace) for _ in range(rows)]
        self._pads = np.zeros((len(self._staged), rows), dtype=np.int64)

    def _start(self, prompt, attention_mask) -> None:
        """One sequence per prompt row, all starting from the prefix every row has stored."""
        rows = _prompt_rows(prompt)
        if attention_mask is not None:
            keep = _left_padding(attention_mask, [len(row) for row in rows])
            rows = [row[kept] for row, kept in zip(rows, keep)]
        block = self.kv.layout.block_tokens
        # whole blocks every row has stored, leaving each row at least one token to compute
        common = min(min(self.kv.match_prefix(row, self.namespace), (len(row) - 1) // block * block) for row in rows)
        if attention_mask is not None and not all(keep.all() for keep in keep):
            common = 0  # padded rows start at different positions: no common stored prefix
        self.sequences = []
        for row in rows:
            seq = self.kv.sequence(tokens=row[: common + 1], namespace=self.namespace)
            seq.add_tokens(row[common + 1 :])
            self.sequences.append(seq)
        self._pads = np.zeros((len(self._staged), len(rows)), dtype=np.int64)

    def _see_tokens(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Tells each row's sequence the ids of the tokens this pass computes (``[batch, t]``,
        positions ``seq_length()`` on; left padding, 0 in the 2-D ``mask``, left out), so the
        blocks they fill get content keys. Ids a row already knows (its prompt) must match:
        KV stored under another prompt's content keys would later be served for that prompt.

        Raises:
            UserError: the ids differ from the prompt the cache was made for; the batch from
                the cache's rows; padding that is not on the left of a row.
        """
        if not self.sequences:
            self._open(ids.shape[0])
        if ids.dim() != 2 or ids.shape[0] != len(self.sequences):
            raise UserError(f"TieredCache: input_ids of shape {tuple(ids.shape)} for a cache of {len(self.sequences)} rows")
        start, tokens = self.seq_length(0), ids.shape[1]
        keep = self._kept_columns(mask, start, tokens)
        self._pass = None if keep is None else (start, torch.as_tensor(keep, device=self.kv.device))
        for row, seq in enumerate(self.sequences):
            given = ids[row].detach().cpu().numpy()
            self._learn(row, seq, given if keep is None else given[keep[row]])

    def _learn(self, row: int, seq: Sequence, given: np.ndarray) -> None:
        """Adds the ids of a row's new tokens its sequence does not know yet (checking those it knows)."""
        known, held = seq.token_ids, seq.length(0)
        if len(known) < held:
            return  # a pass without ids (inputs_embeds) came first: later blocks stay private
        overlap = min(len(known) - held, len(given))
        if not np.array_equal(known[held : held + overlap], given[:overlap]):
            raise UserError(f"TieredCache: row {row}: the input ids of tokens {held}..{held + overlap - 1} differ "
                            "from the prompt the cache was made for (pass generate the same ids)")
        if overlap < len(given):
            seq.add_tokens(given[overlap:])

    def _kept_columns(self, mask: torch.Tensor | None, start: int, tokens: int) -> np.ndarray | None:
        """The pass's columns that are not left padding (``[batch, t]`` bools), from the 2-D
        attention mask of the whole sequence; None when every column is kept."""
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            return None
        if mask.shape != (len(self.sequences), start + tokens):
            raise UserError(f"TieredCache: attention_mask of shape {tuple(mask.shape)}, expected "
                            f"({len(self.sequences)}, {start + tokens}) (the whole sequence so far)")
        held = [seq.length(0) for seq in self.sequences]
        keep = _left_padding(mask, [start + tokens] * len(held))
        for row, kept in enumerate(keep):
            pad = int(self._pads[0, row])
            if kept[:pad].any() or not kept[pad:start].all() or (held[row] and not kept[start:].all()):
                raise UserError(f"TieredCache: row {row}: the attention mask changes the row's past padding "
                                "(only a prompt's left padding is supported)")
        new = np.stack([kept[start:] for kept in keep])
        return None if new.all() else new

    def _stage(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._staged[layer] is not None:
            raise UserError("TieredCache: the model's attention did not read the tiered KV (its attention "
                            f"implementation is not {ATTENTION!r}); call use_tiercache(model) first")
        if not self.sequences:
            self._open(k.shape[0])
        if k.shape[0] != len(self.sequences):
            raise UserError(f"TieredCache: batch of {k.shape[0]} rows, but the cache holds {len(self.sequences)} sequences")
        self._staged[layer] = (k, v)

    def _attend(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of ``query`` (``[batch, heads, t, D]``) over each row's held tokens and
        the staged new ones; appends the staged tokens. Returns ``[batch, t, heads, D]``."""
        k_new, v_new = self._staged[layer]
        self._staged[layer] = None
        batch, heads, tokens, head_dim = query.shape
        q = query * (scaling * math.sqrt(head_dim)) if not math.isclose(scaling * math.sqrt(head_dim), 1.0) else query
        q = q.to(self.kv.dtype)
        keep = self._keep(layer, tokens)
        outs = []
        for row, seq in enumerate(self.sequences):
            k_row, v_row = k_new[row], v_new[row]
            if tokens == 1 and keep is None:  # decode: the token joins its sequence first, one read covers it
                seq.append(layer, k_row.contiguous(), v_row.contiguous())
                part = self._decode_partial(seq, layer, q[row].contiguous())
            else:
                part = self._prefill_partial(seq, layer, q[row], k_row, v_row, None if keep is None else keep[row])
                self._pads[layer, row] += tokens - (tokens if keep is None else int(keep[row].sum()))
            outs.append(part.out.reshape(heads, tokens, head_dim))
        return torch.stack(outs).transpose(1, 2).to(query.dtype)

    def _keep(self, layer: int, tokens: int) -> torch.Tensor | None:
        """The kept (not padding) columns of this pass (``[batch, t]``), None: all of them."""
        if self._pass is None:
            return None
        start, keep = self._pass
        return keep if start == self.seq_length(layer) and keep.shape[1] == tokens else None

    def _prefill_partial(self, seq: Sequence, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         keep: torch.Tensor | None) -> Partial:
        """A row's queries over what its sequence holds and, causally, over the pass's kept
        keys; appends the kept keys."""
        key_pos = None if keep is None else keep.nonzero().squeeze(1)
        if key_pos is not None:
            k, v = k[:, key_pos], v[:, key_pos]
        part = causal_partial(q, k, v, compute_dtype(self.kv.dtype), key_pos)
        if seq.length(layer):
            part = merge(seq.attend_partial(layer, q.contiguous()), part)
        if k.shape[1]:
            seq.append(layer, k.contiguous(), v.contiguous())
        return part

    def _decode_partial(self, seq: Sequence, layer: int, q: torch.Tensor) -> Partial:
        """One decode query's attention over everything its sequence holds at ``layer`` (the
        new token included), in the cache's mode (exact while no block is full)."""
        if self.mode is AttentionMode.SPARSE and seq.blocks(layer) > 0:
            return seq.attend_partial(layer, q, AttentionMode.SPARSE, self.budget)
        return seq.attend_partial(layer, q)

    def _check_mask(self, mask: torch.Tensor | None, layer: int, tokens: int) -> None:
        """Raises UserError unless ``mask`` lets every (non-padding) query see what the cache
        gives it: the row's held positions after its left padding, and the pass's kept tokens
        causally (``causal.expected_mask``). Padding queries' rows are not compared: their
        output is thrown away."""
        if mask is None or mask is self._checked_mask:
            return
        held = self.seq_length(layer)
        keep = self._keep(layer, tokens)
        allowed = (mask if mask.dtype == torch.bool else mask == 0)
        expected = expected_mask([int(p) for p in self._pads[layer]], keep, held, tokens, mask.device)
        if allowed.dim() != 4 or allowed.shape[2:] != expected.shape[1:] or allowed.shape[0] not in (1, len(self.sequences)):
            raise UserError(f"TieredCache: an attention mask of shape {tuple(mask.shape)}, expected "
                            f"({len(self.sequences)}, 1, {tokens}, {held + tokens})")
        differ = allowed[:, 0] != expected
        if keep is not None:
            differ &= keep.unsqueeze(-1)
        if bool(differ.any()):
            raise UserError("TieredCache: the attention mask is not causal over each row's tokens (padding other than "
                            "a prompt's left padding, or a custom mask)")
        self._checked_mask = mask


def tiercache_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """The ``"tiercache"`` attention implementation (``transformers``' AttentionInterface).

    ``key`` and ``value`` are the new tokens a ``TieredCache`` layer staged; the attention
    runs over what the cache holds plus them (see the module docstring).

    Raises:
        UserError: no ``TieredCache`` staged this layer; dropout, soft-capping or a sliding
            window asked for; a mask that is not causal.
    """
    stage = getattr(key, _STAGE, None)
    if stage is None:
        raise UserError(f"attn_implementation={ATTENTION!r} needs a TieredCache as the model's cache "
                        "(generate(..., past_key_values=TieredCache(...)))")
    cache, layer = stage
    if dropout:
        raise UserError(f"{ATTENTION} attention: dropout {dropout} is not supported (inference only)")
    for name in ("softcap", "sliding_window"):
        if kwargs.get(name) is not None:
            raise UserError(f"{ATTENTION} attention: {name}={kwargs[name]!r} is not supported")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    cache._check_mask(attention_mask, layer, query.shape[2])
    with torch.no_grad():
        return cache._attend(layer, query, scaling), None


def _check_config(kv: TieredKVCache, config: Any) -> None:
    if not isinstance(kv, TieredKVCache):
        raise UserError(f"TieredCache: kv must be a TieredKVCache, got {type(kv).__name__}")
    if getattr(config, "_attn_implementation", None) != ATTENTION:
        raise UserError(f"TieredCache: the model's attention implementation is "
                        f"{getattr(config, '_attn_implementation', None)!r}, not {ATTENTION!r}; "
                        "call use_tiercache(model) first")
    want = kv_layout(config, torch_dtype(kv.layout.dtype), kv.layout.block_tokens)
    got = kv.layout
    for field in ("layers", "kv_heads", "head_dim"):
        if getattr(want, field) != getattr(got, field):
            raise UserError(f"TieredCache: the TieredKVCache's layout has {field}={getattr(got, field)}, the model "
                            f"{getattr(want, field)} (build it with kv_layout(model.config, ...))")


def _prompt_rows(prompt) -> list:
    """The prompt as a list of flat int64 id arrays, one per batch row."""
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 2:
        return [flat_token_ids(row, "TieredCache: prompt") for row in prompt]
    if isinstance(prompt, torch.Tensor) and prompt.dim() != 1:
        raise UserError(f"TieredCache: prompt must be [batch, n] or [n] token ids, got {tuple(prompt.shape)}")
    if not isinstance(prompt, torch.Tensor) and prompt and not isinstance(prompt[0], int) and hasattr(prompt[0], "__len__"):
        return [flat_token_ids(row, "TieredCache: prompt") for row in prompt]
    return [flat_token_ids(prompt, "TieredCache: prompt")]


def _left_padding(mask, lengths: list[int]) -> list[np.ndarray]:
    """Each row's kept (not padding) columns of a ``[batch, n]`` 0/1 attention mask, checking
    that zeros only lead a row (left padding).

    Raises:
        UserError: a mask of another shape, or a zero after a one in some row.
    """
    values = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
    if values.ndim != 2 or values.shape[0] != len(lengths) or any(values.shape[1] != n for n in lengths):
        raise UserError(f"TieredCache: attention_mask of shape {values.shape} for rows of {lengths} tokens")
    keep = [row != 0 for row in values]
    for index, kept in enumerate(keep):
        if kept.any() and not kept[int(np.argmax(kept)):].all():
            raise UserError(f"TieredCache: row {index} of the attention mask has padding after a token "
                            "(only left padding is supported)")
    return keep


register()
