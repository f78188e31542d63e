"""What a ``TieredCache`` (``tiercache.integrations.cache``) checks before it stores anything:
the model and the ``TieredKVCache`` it is made with, its attention mode, the decoding mode
``generate`` asks for, and a forward pass's ids, padding and positions.

Every check raises a ``UserError`` naming what was wrong; none changes the cache.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from tiercache.config import AttentionMode
from tiercache.data.buffers import torch_dtype
from tiercache.errors import UserError
from tiercache.live.arguments import attend_blocks
from tiercache.live.cache import TieredKVCache

from .hooks import decoder_of, installed
from .inputs import (check_supported, kv_layout, left_padding, model_fingerprint, stamped_tensors, tensor_state, text_config,
                     weights_stamp)

__all__ = ["ATTENTION", "FINGERPRINT", "STAMP", "current_fingerprint", "fingerprint_of_pass", "fingerprint_weights", "check_decoding", "check_kv_heads", "check_mode", "check_model",
           "first_position", "kept_columns", "pass_tokens"]

#: The ``attn_implementation`` name of the attention that reads a ``TieredCache``.
ATTENTION = "tiercache"
FINGERPRINT = "_tiercache_fingerprint"  # the model's weights fingerprint, set by use_tiercache
STAMP = "_tiercache_weights_stamp"  # inputs.weights_stamp when FINGERPRINT was computed

# generate's options that pick a decoding mode whose drafts run through the model's own cache
# (each refused before any pass, so the cache stays usable): (option, mode's name). Assisted
# decoding with an assistant model and prompt lookup run: the cache crops rejected drafts.
_ASSISTED = (("assistant_early_exit", "assisted decoding (assistant_early_exit)"),
             ("use_mtp", "multi-token-prediction decoding (use_mtp)"))


def fingerprint_weights(model: Any) -> bytes:
    """Computes the model's weights fingerprint (``inputs.model_fingerprint``), stores it on
    the model with the ``weights_stamp`` it was computed at and the tensors that stamp
    follows (for ``fingerprint_of_pass``), and returns it."""
    stamp = weights_stamp(model)
    fingerprint = model_fingerprint(model)
    setattr(model, FINGERPRINT, fingerprint)
    setattr(model, STAMP, (stamp, [tensor for _, tensor in stamped_tensors(model)]))
    return fingerprint


def current_fingerprint(model: Any) -> bytes:
    """The readied model's weights fingerprint, computed anew when its ``weights_stamp`` changed
    since the stored one was (``load_state_dict``, an in-place change through torch, a moved or
    replaced weight): a cache made after such a change keys its KV by the new weights, never
    reusing the old ones' (a cache made before refuses its next pass: ``fingerprint_of_pass``).
    A write the stamp cannot see (through ``tensor.data``) needs ``use_tiercache(model)`` again."""
    stored = getattr(model, STAMP, None)
    if stored is None or stored[0] != weights_stamp(model):
        return fingerprint_weights(model)
    return getattr(model, FINGERPRINT)


def fingerprint_of_pass(model: Any) -> bytes:
    """``current_fingerprint`` as a forward pass checks it: first only the address and version
    of each tensor the stored stamp follows (no module walk: about 0.45 us a tensor), the whole
    stamp only when one of them changed. A weight replaced by a new tensor object while the old
    one stays unchanged is seen by the next cache made, not by this check."""
    stored = getattr(model, STAMP, None)
    if stored is None:
        return current_fingerprint(model)
    stamp, tensors = stored
    if any(tensor_state(tensor) != entry[2:] for tensor, entry in zip(tensors, stamp)):
        return current_fingerprint(model)
    return getattr(model, FINGERPRINT)


def check_model(kv: TieredKVCache, model: Any) -> None:
    """Raises UserError unless ``kv`` is an open TieredKVCache, ``model`` is switched to the
    tiercache attention and ``kv``'s layout and dtype are the model's."""
    if not isinstance(kv, TieredKVCache):
        raise UserError(f"TieredCache: kv must be a TieredKVCache, got {type(kv).__name__}")
    if kv._closed:
        raise UserError("TieredCache: its TieredKVCache is closed; make the cache over an open one")
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise UserError(f"TieredCache: model must be a transformers model, got {type(model).__name__}")
    config = text_config(model.config)
    check_supported(model.config)
    if getattr(config, "_attn_implementation", None) != ATTENTION or not installed(model) or not hasattr(model, FINGERPRINT):
        raise UserError(f"TieredCache: the model's attention implementation is "
                        f"{getattr(config, '_attn_implementation', None)!r}, not {ATTENTION!r}; "
                        "call use_tiercache(model) first")
    want = kv_layout(config, torch_dtype(kv.layout.dtype), kv.layout.block_tokens)
    for field in ("layers", "kv_heads", "head_dim"):
        if getattr(want, field) != getattr(kv.layout, field):
            raise UserError(f"TieredCache: the TieredKVCache's layout has {field}={getattr(kv.layout, field)}, the model "
                            f"{getattr(want, field)} (build it with kv_layout(model.config, ...))")
    dtype = getattr(model, "dtype", None)
    if dtype is not None and dtype != kv.dtype:
        raise UserError(f"TieredCache: the model computes in {dtype}, the TieredKVCache stores {kv.dtype}; "
                        "build its layout with kv_layout(model.config, model.dtype)")


def check_kv_heads(model: Any) -> None:
    """Raises UserError when the attention layers of the model's decoder say they use another
    number of KV heads than ``kv_layout`` reads from the config (``config.num_key_value_heads``
    that the model ignores: ``GPTBigCodeConfig(num_attention_heads=4, multi_query=False)``
    reports 12 while its layers use 4), or different numbers from layer to layer (MiMo-V2-Flash's
    sliding layers: a layout has one). A layer says it by a ``num_key_value_heads``,
    ``num_kv_heads`` or ``kv_heads`` attribute, else by ``num_key_value_groups`` (its query
    heads per KV head); a layer that says neither is not checked (``TieredLayer.update``
    still refuses K or V of another shape than the layout's, before it stores them)."""
    config = text_config(model.config)
    want = kv_layout(config, torch.float32).kv_heads
    used = {}  # layer index -> KV heads its attention says it uses
    for module in decoder_of(model).modules():
        index = getattr(module, "layer_idx", None)
        got = _kv_heads_of(module, config.num_attention_heads) if isinstance(index, int) else None
        if got is not None:
            used.setdefault(index, got)
    if len(set(used.values())) > 1:
        first = {}  # KV heads -> the first layer that uses them
        for index in sorted(used):
            first.setdefault(used[index], index)
        named = ", ".join(f"layer {index}: {heads}" for heads, index in first.items())
        raise UserError(f"use_tiercache: {config.model_type}'s layers use different numbers of KV heads ({named}): "
                        "not supported (a TieredKVCache's layout has one for every layer)")
    for index, got in used.items():
        if got != want:
            said = getattr(config, "num_key_value_heads", None)
            raise UserError(f"use_tiercache: layer {index} of {config.model_type} uses {got} KV heads, but the "
                            f"config says num_key_value_heads={said} (kv_layout would size the cache for {want}); "
                            f"set config.num_key_value_heads={got}, the heads the model uses")


def _kv_heads_of(module: torch.nn.Module, heads: int) -> int | None:
    """The KV heads an attention module says it uses (``check_kv_heads``); None: it does not say."""
    for name in ("num_key_value_heads", "num_kv_heads", "kv_heads"):
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    groups = getattr(module, "num_key_value_groups", None)
    if not isinstance(groups, int) or isinstance(groups, bool) or groups <= 0:
        return None
    own = next((value for name in ("num_heads", "num_attention_heads")
                if isinstance(value := getattr(module, name, None), int) and value > 0), heads)
    return own // groups if own % groups == 0 else None


def check_mode(mode: AttentionMode, budget) -> None:
    """Raises UserError (naming ``TieredCache``) for a mode that is not an ``AttentionMode``,
    a budget without SPARSE (or SPARSE without one), or a bad budget: the raw API's own check
    (``attend_blocks``), made when the cache is built rather than at the first decode step."""
    attend_blocks(mode, budget, 1, "TieredCache")


def check_decoding(kwargs: dict, model: Any | None, holds_rows: bool) -> int:
    """Raises UserError when ``generate``'s options (``_generate_option``) pick constrained beam
    search, contrastive search, early-exit assisted decoding or multi-token prediction: they
    select the cache's rows or draft through its layers, which a ``TieredCache`` cannot, and
    transformers would refuse them only after passes had stored KV; classifier-free guidance
    (``guidance_scale``: an extra pass without the cache); or ``use_cache=False`` (every pass
    feeds the whole sequence again from position 0: its second pass would be refused after the
    first had stored the prompt's KV). Assisted decoding with an assistant
    model and prompt lookup run (``TieredCache.crop`` drops rejected drafts), on a cache that
    holds no rows yet (``holds_rows``: made with ``prompt=``, or continued): transformers' first
    verification pass feeds the whole prompt again, from position 0.

    Returns:
        The rows generate makes of each given row: ``max(num_beams, num_return_sequences)``
        (transformers repeats each row that many times; a cache that holds its rows forks them).
    """
    option = _generate_option(kwargs, model)
    mode = None
    if option("constraints") is not None or option("force_words_ids") is not None:
        mode = "constrained beam search (constraints, force_words_ids)"
    elif (option("penalty_alpha") or 0) > 0 and (option("top_k") or 0) > 1 and not option("do_sample"):
        mode = "contrastive search (penalty_alpha)"
    else:
        mode = next((what for name, what in _ASSISTED if option(name) not in (None, False)), None)
    if mode is not None:
        raise UserError(f"TieredCache: {mode} is not supported (it selects the cache's rows or drafts through its "
                        "layers); nothing was run and the cache is unchanged: use greedy search, sampling, beam "
                        "search, prompt lookup or an assistant model")
    drafted = option("assistant_model") is not None or option("prompt_lookup_num_tokens") not in (None, 0)
    if drafted and holds_rows:
        raise UserError("TieredCache: assisted decoding and prompt lookup need a cache that holds no rows yet, made "
                        "without prompt= (their first pass feeds the whole prompt again); nothing was run and the "
                        "cache is unchanged")
    if option("use_cache") is not None and not option("use_cache"):
        raise UserError("TieredCache: use_cache=False (every pass over the whole sequence again, without the cache) "
                        "is not supported with a TieredCache: drop use_cache=False, or do not pass the cache; nothing "
                        "was run and the cache is unchanged")
    if option("guidance_scale") not in (None, 1, 1.0):
        raise UserError("TieredCache: guidance_scale (classifier-free guidance) runs an extra pass without the "
                        "cache: not supported; nothing was run and the cache is unchanged")
    return max(int(option("num_beams") or 1), int(option("num_return_sequences") or 1))


#: New tokens ``generate`` makes when nothing sets a length (transformers' default ``max_length``,
#: counted past the prompt).
DEFAULT_NEW_TOKENS = 20


def check_windows_fit(kwargs: dict, model: Any | None, prompt: int, of_ids: bool,
                      windows: tuple[int | None, ...]) -> None:
    """Raises UserError before ``generate`` runs when its longest sequence would outgrow a
    layer's sliding window (the refusal at the pass that outgrows it would come after
    every token before it had been computed, and lose them). ``prompt`` is the prompt's
    positions (ids or embeddings, padding included); ``of_ids``: the prompt is ids.

    The longest sequence generate feeds is one position short of its final length
    (``_final_length``; the last token is never fed), plus, with prompt lookup, the
    ``prompt_lookup_num_tokens - 1`` candidates its last verification pass may feed past it.
    """
    final, told = _final_length(kwargs, model, prompt, of_ids)
    lookup = _generate_option(kwargs, model)("prompt_lookup_num_tokens")
    extra = max(int(lookup) - 1, 0) if lookup else 0  # its last verification's candidates past the end
    if lookup:
        told += f" with prompt_lookup_num_tokens={int(lookup)}"
    fed = final - 1 + extra
    for layer, window in enumerate(windows):
        if window is not None and fed > window:
            room = window + 1 - prompt - extra
            ask = f"ask for at most {room} new tokens" if room > 0 else "the prompt alone leaves no room for a new token"
            raise UserError(f"TieredCache: layer {layer}'s sliding_window={window} is not supported once the sequence "
                            f"outgrows it, and {told} would feed {fed} positions; nothing was run and the cache is "
                            f"unchanged: {ask}")


def _final_length(kwargs: dict, model: Any | None, prompt: int, of_ids: bool) -> tuple[int, str]:
    """(positions, what sets them): the length a ``generate`` may reach, as transformers 5
    sizes it (``_prepare_generated_length``): ``prompt + max_new_tokens`` where any of its
    options sets ``max_new_tokens``, else ``max_length`` where one sets that, else the
    default of ``DEFAULT_NEW_TOKENS`` new tokens, capped (for a prompt of ids) at the model's
    ``max_position_embeddings``."""
    option = _generate_option(kwargs, model)
    new, longest = option("max_new_tokens"), option("max_length")
    if new is not None:
        return prompt + int(new), f"the prompt's {prompt} positions and max_new_tokens={int(new)}"
    if longest is not None:
        return int(longest), f"max_length={int(longest)}"
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) if of_ids else None
    final = prompt + DEFAULT_NEW_TOKENS if limit is None else min(prompt + DEFAULT_NEW_TOKENS, int(limit))
    return final, f"the prompt's {prompt} positions and generate's default of {DEFAULT_NEW_TOKENS} new tokens"


def _generate_option(kwargs: dict, model: Any | None) -> Callable[[str], Any]:
    """How ``generate`` (transformers 5) reads an option: a reader of ``name`` that gives its
    keyword argument when given (None too: transformers sets a given keyword over both
    configs, ``GenerationConfig.update``), else the ``generation_config`` passed where it
    sets it, else the model's (None where none sets it): transformers fills a passed
    config's unset options from the model's."""
    configs = [kwargs.get("generation_config"), getattr(model, "generation_config", None)]

    def option(name: str):
        if name in kwargs:
            return kwargs[name]
        return next((getattr(c, name) for c in configs if getattr(c, name, None) is not None), None)

    return option


def kept_columns(mask, start: int, tokens: int, held: list[int], pads: np.ndarray) -> np.ndarray | None:
    """The pass's columns that are not left padding (``[batch, t]`` bools), from the 2-D
    attention mask of the whole sequence (``held[b]`` tokens and ``pads[b]`` padding before
    ``start``); None when every column is kept. A row may be all padding in a pass (a
    chunk of a chunked prefill) until its first token."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    if mask.shape != (len(held), start + tokens):
        raise UserError(f"TieredCache: attention_mask of shape {tuple(mask.shape)}, expected "
                        f"({len(held)}, {start + tokens}) (the whole sequence so far)")
    keep = left_padding(mask, [start + tokens] * len(held))
    for row, kept in enumerate(keep):
        pad = int(pads[row])
        if kept[:pad].any() or not kept[pad:start].all() or (held[row] and not kept[start:].all()):
            raise UserError(f"TieredCache: row {row}: the attention mask changes the row's past padding "
                            "(only a prompt's left padding is supported)")
    new = np.stack([kept[start:] for kept in keep])
    return None if new.all() else new


def first_position(position_ids: torch.Tensor | None, tokens: int) -> int:
    """The smallest position of a pass's first column (0 when transformers picks them)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.numel() == 0:
        return 0
    return int(position_ids.reshape(-1, tokens)[:, 0].min()) if position_ids.shape[-1] == tokens else 0


def pass_tokens(ids: torch.Tensor | None, kwargs: dict) -> torch.Tensor:
    """What gives a pass its batch and token count: the ids, else the embeddings."""
    tokens = ids if ids is not None else kwargs.get("inputs_embeds")
    if not isinstance(tokens, torch.Tensor):
        raise UserError("TieredCache: a forward pass needs input_ids or inputs_embeds")
    return tokens
