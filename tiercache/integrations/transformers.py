"""A drop-in ``transformers`` cache over tiercache's tiers, and the attention that reads it.

``TieredCache`` is a ``transformers`` ``Cache`` whose layers keep no tensors: every token's
KV goes into a ``TieredKVCache`` sequence per batch row (HBM, then DRAM and NVMe as the
policies decide), and the ``"tiercache"`` attention implementation reads it back from
wherever it lies, chunk by chunk through a bounded window (``Sequence.attend_partial``).
A model's KV is therefore bounded by the tiers, not by its device memory::

    from tiercache.integrations.transformers import TieredCache, kv_layout, use_tiercache

    use_tiercache(model)                             # attn_implementation="tiercache"
    kv = TieredKVCache(kv_layout(model.config, torch.float32, block_tokens=16), tiers, path=nvme_dir, device="cpu")
    cache = TieredCache(kv, model, prompt=input_ids)   # reuses the stored prefix
    out = model.generate(input_ids, cache=cache, max_new_tokens=32)
    cache.free()                                     # blocks stay stored for the next prompt

How a forward pass goes through it: the model's attention calls ``cache.update`` with the
new tokens' K and V; the layer stages them (nothing is stored yet) and returns them
tagged; the ``"tiercache"`` attention then computes, for each batch row, attention over the
tokens the sequence already holds (every query sees all of them) merged by log-sum-exp
with causal attention over the new tokens, and only then appends the new tokens. A decode
step (a one-token pass past the prompt) appends first and reads once, in the cache's ``mode``
(``AttentionMode.SPARSE`` reads only the top blocks, as ``Sequence.attend``); every pass of
the prompt is exact.

``use_tiercache`` also hooks the model (``hooks``): its decoder's forward hooks hand every
pass's inputs to the cache, however the model is called, so the blocks generated tokens fill
get content keys (a chat's next turn finds the whole conversation so far), and ``generate``
checks its inputs against the cache's ``prompt=``.
Content keys are only given where the same ids always give the same KV: each includes the
model's weights fingerprint (``inputs.model_fingerprint``), and a pass whose KV depends on more
than ids at their standard positions (``inputs_embeds``, an image, custom positions) makes its
rows' KV private from there on; so is all KV of a model whose RoPE depends on the pass's
length (``inputs.length_dependent_rope``: "dynamic", "longrope"). A pass that raised is found at
the next one: undone if it stored nothing, else the cache refuses further passes (``free`` it).

Invariants: between forward passes every row has passed the same positions at every layer
(its tokens of KV plus its unstored left padding); a staged update is consumed by the attention of the same layer before the
next update of that layer (else the model's attention is not ``"tiercache"`` and the
cache raises rather than return attention over the new tokens alone).

Batches: each row is its own sequence. A row's left padding (0 in the 2-D attention mask the
pre-hook sees) is not stored: ``seq_length()`` counts it (transformers' positions), the row's
sequence holds only its tokens, and the attention gives padding queries a zero output.

Limits (each raises ``UserError`` naming it): padding after a token or any other mask than
causal-after-left-padding, a model whose attention reads other K or V than its cache update
returned (refused before anything is stored), V heads of another size than K's, layers whose
KV heads are not the config's, constrained beam search, row selection, attention dropout,
soft-capping, attention sinks or any other attention argument it does not know, a sliding
window the sequence outgrows, ``output_attentions``; a backward pass through its attention
raises (the KV is stored without gradients).
"""

from __future__ import annotations

from tiercache.extras import require

require("torch", "transformers", what="tiercache.integrations (the transformers cache)")

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tiercache.errors import UserError
from tiercache.live.cache import TieredKVCache

from .cache import ATTENTION, FINGERPRINT, TieredCache
from .checks import check_kv_heads, current_fingerprint, fingerprint_weights
from .hooks import install
from .inputs import check_supported, kv_layout, length_dependent_rope, namespace_bytes, prompt_rows, text_config
from .layer import STAGE, TieredLayer, unread_stage

__all__ = ["ATTENTION", "TieredCache", "TieredLayer", "kv_layout", "use_tiercache", "register", "match_prefix",
           "tiercache_attention"]

# Attention arguments that do not change what attention computes; any other one given (not
# None or False) is refused rather than ignored (attention sinks ``s_aux``/``sinks``, ...).
_IGNORED = frozenset({"position_ids", "use_cache", "cache_position", "output_router_logits", "output_hidden_states",
                      "return_dict", "logits_to_keep"})


def use_tiercache(model: Any) -> Any:
    """Readies ``model`` (a ``transformers`` model) for a ``TieredCache``: switches its
    language model to the ``"tiercache"`` attention, fingerprints its weights (part of every
    content key), hooks its decoder's forward passes (token ids, pass bookkeeping) and its
    ``generate`` (the inputs are checked against the cache's prompt). Returns the model.
    Idempotent. A ``TieredCache`` made after the weights changed through torch fingerprints
    them anew (``checks.current_fingerprint``); call it again after a write torch does not
    track (through ``tensor.data``).

    Raises:
        UserError: the model cannot switch its attention implementation, caches something
            else than per-head K and V of one head size, attends over other K or V than its
            cache update returns (DiffLlama, JetMoE), or its layers use other KV heads than
            its config says (``checks.check_kv_heads``).
    """
    register()
    check_supported(model.config)
    previous = text_config(model.config)._attn_implementation
    _switch_attention(model)  # first: a model without AttentionInterface is refused for that
    try:
        check_kv_heads(model)
    except UserError:
        _set_attention(model, previous)  # refused: the model keeps the attention it had
        raise
    fingerprint_weights(model)  # always anew: a change the weights' stamp cannot see is caught here
    install(model)
    return model


def match_prefix(kv: TieredKVCache, model: Any, tokens, namespace: bytes | str = b"") -> int:
    """Tokens of ``tokens``' prefix that ``kv`` holds for ``model`` (whole blocks), as a
    ``TieredCache(kv, model, prompt=tokens, namespace=namespace)`` would find them (before
    leaving a token to compute).

    ``tokens`` is one sequence: ``[n]`` or ``[1, n]`` ids (a list, array or tensor). A batch
    is refused rather than answered for its rows run together: call it once per row (an
    unpadded batch ``prompt=`` starts every row from the smallest of the rows' answers).

    Raises:
        UserError: the model is not readied; ``tokens`` is not one sequence of integer ids;
            a bad namespace.
    """
    if getattr(model, FINGERPRINT, None) is None:
        raise UserError("match_prefix: the model is not readied for tiercache; call use_tiercache(model) first")
    fingerprint = current_fingerprint(model)
    rows = prompt_rows(tokens, "match_prefix: tokens", ragged="call match_prefix once per row")
    if len(rows) != 1:
        raise UserError(f"match_prefix: tokens has {len(rows)} rows; it answers for one sequence: call it once "
                        "per row")
    if length_dependent_rope(model.config):  # its KV is never keyed: no prefix is reused
        return 0
    return kv.match_prefix(rows[0], fingerprint + namespace_bytes(namespace))


def register() -> None:
    """Registers the ``"tiercache"`` attention and its mask (transformers' boolean SDPA mask,
    or none for a plain causal batch) with ``transformers``. Idempotent."""
    AttentionInterface.register(ATTENTION, tiercache_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def tiercache_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The ``"tiercache"`` attention implementation (``transformers``' AttentionInterface).

    ``key`` and ``value`` must be the new tokens' K and V a ``TieredCache`` layer staged, as
    its ``update`` returned them (``_staged_layer``); the attention runs over what the cache
    holds plus them (see the module docstring). Every refusal comes before it stores anything.

    Raises:
        UserError: no ``TieredCache`` staged this layer; a K or V that is not the one staged
            (a model that transforms them after the cache update, or calls the attention more
            than once per layer); dropout, an attention argument it does not know, or a
            sliding window the sequence outgrows; a mask that is not causal; (on backward) a
            gradient asked of it.
    """
    cache, layer = _staged_layer(module, key, value)
    if dropout:
        raise UserError(f"{ATTENTION} attention: dropout {dropout} is not supported (inference only)")
    if not getattr(module, "is_causal", True):
        raise UserError(f"{ATTENTION} attention: {type(module).__name__} is not causal (bidirectional attention "
                        "is not supported)")
    unknown = sorted(name for name, value in kwargs.items() if name not in _IGNORED and value is not None and value is not False)
    if unknown:
        raise UserError(f"{ATTENTION} attention: {', '.join(unknown)} not supported ({type(module).__name__} passes "
                        "arguments this attention does not implement)")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    cache.check_window(layer, query.shape[2], sliding_window)
    cache.check_mask(attention_mask, layer, query.shape[2])
    out = cache.attend(layer, query, scaling)
    if torch.is_grad_enabled() and query.requires_grad:
        out = _NoGradient.apply(query, out)
    return out, None


def _staged_layer(module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor) -> tuple[TieredCache, int]:
    """The (cache, layer) whose staged K and V the attention was given: ``key`` carries the
    tag ``TieredLayer.update`` set, and ``value`` is the V it staged (the same tensor, or one
    equal to it). The staged K and V are what the attention attends over and stores.

    Raises:
        UserError: naming which: no ``TieredCache`` staged this layer (a pass without one);
            a K other than the staged one (the model transformed it after the update: JetMoE
            repeats K and V); this layer's attention already ran in this pass; a V other than
            the staged one (DiffLlama attends over each half of V).
    """
    name = type(module).__name__
    stage = getattr(key, STAGE, None)
    if stage is None:
        unread = unread_stage()
        if unread is not None:
            raise UserError(f"{ATTENTION} attention: {name} (layer {unread[1]}) gave the attention another K than "
                            "the TieredCache staged at its cache update (the model transforms K or V after the "
                            "update, as JetMoE repeats them): not supported; nothing was stored")
        raise UserError(f"attn_implementation={ATTENTION!r} needs a TieredCache as the model's cache, and no "
                        "TieredCache staged this layer's KV in this forward pass (generate(..., "
                        "cache=TieredCache(kv, model)); an extra pass of generate's own, such as guidance_scale's, "
                        "cannot use it, nor can an assistant_model readied with use_tiercache: transformers makes "
                        "its cache, so give it a plain model; a model that reads its cache's K and V without the "
                        "cache's update, as Dory's last_loop mode does, is not supported)")
    cache, layer = stage
    staged = cache.layers[layer].staged()
    if staged is None:
        raise UserError(f"{ATTENTION} attention: {name} ran the attention of layer {layer} again in one pass "
                        "(a model that calls the attention more than once per layer is not supported); free() the "
                        "cache")
    if not _same(value, staged[1]):
        raise UserError(f"{ATTENTION} attention: {name} (layer {layer}) gave the attention another V than the "
                        "TieredCache staged at its cache update (the model transforms V after the update, or calls "
                        "the attention more than once per layer over parts of it, as DiffLlama does): not "
                        "supported; nothing was stored")
    return cache, layer


def _same(given: torch.Tensor, staged: torch.Tensor) -> bool:
    """Whether ``given`` is ``staged`` or holds the same values in the same shape (the
    values are compared only when it is another tensor)."""
    if given is staged:
        return True
    return (isinstance(given, torch.Tensor) and given.shape == staged.shape and given.dtype == staged.dtype
            and given.device == staged.device and torch.equal(given, staged))


class _NoGradient(torch.autograd.Function):
    """Joins the attention output to the graph so that a backward pass through it raises
    instead of silently leaving the projections without gradients."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise UserError(f"{ATTENTION} attention has no gradient (its KV is stored without one); "
                        "train with another attention implementation")


def _switch_attention(model: Any) -> None:
    """Switches the model's language model (only it: a vision tower keeps its attention).

    Raises:
        UserError: the language model's config cannot be found, or the model cannot switch.
    """
    _set_attention(model, ATTENTION)
    if text_config(model.config)._attn_implementation != ATTENTION:
        raise UserError(f"use_tiercache: {type(model).__name__} cannot switch its attention implementation "
                        "(it does not use transformers' AttentionInterface)")


def _set_attention(model: Any, implementation: str) -> None:
    """Sets the attention implementation of the model's language model only.

    Raises:
        UserError: a composite model whose language model's config is not one of its sub-configs.
    """
    config = model.config
    text = text_config(config)
    if text is config:
        model.set_attn_implementation(implementation)
        return
    name = next((name for name in getattr(config, "sub_configs", {}) if getattr(config, name, None) is text), None)
    if name is None:
        raise UserError(f"use_tiercache: cannot find the language model's config of {type(model).__name__}")
    model.set_attn_implementation({name: implementation})
