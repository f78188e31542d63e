"""What a ``TieredCache`` reads from ``transformers``' side: prompts and their padding masks, a
forward pass's keyword arguments (does its KV depend on anything but the token ids and their
positions?), and a model's identity (its weights), which content keys must include.

Content keys name KV by the tokens that produced it; they are right only if the same tokens
always give the same KV. That holds within one model (same weights) for ids at their standard
positions, and for nothing else: not for embeddings passed in place of ids, an image, other
weights. Everything here decides, conservatively, when that holds.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import xxhash

from tiercache.config import KVLayout
from tiercache.errors import UserError
from tiercache.live.arguments import flat_token_ids

__all__ = ["kv_layout", "prompt_rows", "left_padding", "model_fingerprint", "weights_stamp", "stamped_tensors", "tensor_state", "check_supported", "namespace_bytes",
           "other_inputs", "length_dependent_rope", "sliding_windows", "standard_positions", "text_config"]

#: Forward arguments that do not change a pass's KV (beyond ids, mask and cache).
_NEUTRAL = frozenset({"input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                      "return_dict", "logits_to_keep", "num_logits_to_keep", "cache_position", "output_hidden_states",
                      "output_router_logits", "labels"})
# Config fields that name or date a model without changing its KV (left out of its fingerprint).
_UNNAMED = frozenset({"_name_or_path", "name_or_path", "architectures", "transformers_version", "_commit_hash",
                      "_attn_implementation", "_attn_implementation_internal", "attn_implementation"})
_CHUNK_BYTES = 1 << 26  # bytes of a tensor's values hashed (and copied to the host) at a time
_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})
# RoPE types whose frequencies are fixed by the config (transformers' modeling_rope_utils: their
# inv_freq ignores the sequence length, and ``dynamic_rope_update`` leaves them alone). Every
# other type is taken to depend on the pass's length: "dynamic" (NTK scaling recomputed for
# the longest position seen) and "longrope" (short or long factors by whether the pass passes
# original_max_position_embeddings) do; a type not known here is treated as they are.
_STATIC_ROPE = frozenset({"default", "linear", "yarn", "llama3", "proportional"})
# Model types whose attention reads other K or V than the cache update returned, refused by
# use_tiercache (any other such model is refused by the attention itself, before it stores).
_KV_AFTER_UPDATE = {"diffllama": "calls the attention twice per layer, each over half of V (differential attention)",
                    "jetmoe": "repeats K and V after the cache update (mixture of attention heads)"}


def kv_layout(config, dtype: torch.dtype, block_tokens: int = 256) -> KVLayout:
    """The per-layer KV layout of a ``transformers`` model's config (its language model's, for
    a composite one: layers, KV heads, head size) with KV stored as ``dtype``.

    Invariant: K and V of a layer have the same shape (one ``head_dim`` for both).

    Raises:
        UserError: the config lacks a field or holds it per layer (Gemma 4's ``head_dim``);
            V heads of another size than K's (``v_head_dim``); ``dtype`` is not a dtype
            tiercache stores.
    """
    config = text_config(config)
    try:
        layers, heads = config.num_hidden_layers, config.num_attention_heads
        kv_heads = _field(config, "num_key_value_heads", None, "kv_layout") or heads
        head_dim = _head_dim(config, heads, "kv_layout")
    except AttributeError as exc:
        raise UserError(f"kv_layout: the config has no {exc.name!r}: not a decoder config tiercache knows") from None
    name = str(dtype).removeprefix("torch.")
    try:
        return KVLayout(layers, kv_heads, head_dim, name, block_tokens, per_layer=True, name=config.model_type)
    except Exception as exc:  # ConfigError: name the argument that was wrong
        raise UserError(f"kv_layout: {exc}") from None


def prompt_rows(prompt, what: str = "TieredCache: prompt",
                ragged: str = "pad them on the left and give attention_mask") -> list[np.ndarray]:
    """A prompt's rows as flat int64 id arrays: a ``[batch, n]`` or ``[n]`` tensor or array,
    a list of ids or a list of equal-length rows (a ``[n]`` prompt is one row).

    Args:
        prompt: the token ids.
        what: names the argument in errors.
        ragged: the advice an error gives for rows of different lengths.

    Raises:
        UserError: an empty prompt or row, rows of different lengths, more than two
            dimensions, ids that are not integers, or an id beyond int64 (named as such: numpy
            keeps such ids as objects in rows of equal length).
    """
    try:
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.detach().cpu().numpy()
        array = np.asarray(prompt)
    except ValueError:  # ragged nested lists
        raise UserError(f"{what} rows differ in length; {ragged}") from None
    if array.dtype == object and any(np.ndim(value) for value in array.flat):  # rows of sequences numpy could not stack
        raise UserError(f"{what} rows differ in length; {ragged}")
    if array.ndim not in (1, 2) or array.size == 0:
        raise UserError(f"{what} must be [batch, n] or [n] token ids (n >= 1), got shape {array.shape}")
    try:
        return [flat_token_ids(row, what) for row in np.atleast_2d(array)]
    except (TypeError, ValueError) as exc:
        raise UserError(str(exc)) from None


def left_padding(mask, lengths: list[int]) -> list[np.ndarray]:
    """Each row's kept (not padding) columns of a ``[batch, n]`` 0/1 attention mask, checking
    that zeros only lead a row (left padding) and that every row keeps a token.

    Raises:
        UserError: a mask of another shape, a zero after a one, or a row of padding only.
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


def other_inputs(kwargs: dict) -> list[str]:
    """The forward arguments given (not None) that can change a pass's KV besides the ids:
    ``inputs_embeds``, images, audio, token types... (their KV must not get content keys)."""
    return sorted(name for name, value in kwargs.items() if name not in _NEUTRAL and value is not None
                  and value is not False)


def standard_positions(position_ids: torch.Tensor | None, keep: np.ndarray | None, held: list[int],
                       start: int, tokens: int) -> list[bool]:
    """Per row, whether the pass's kept tokens sit at their standard positions (the row's
    token count before them, then one more each), the positions their content keys assume.
    ``position_ids`` None means transformers' default, ``start + i`` for column ``i``."""
    if position_ids is None:
        given = np.broadcast_to(np.arange(start, start + tokens), (len(held), tokens))
    else:
        given = position_ids.detach().cpu().numpy()
        if given.ndim != 2 or given.shape[1] != tokens:
            return [False] * len(held)  # e.g. multimodal rotary sections: not the plain positions
        given = np.broadcast_to(given, (len(held), tokens))
    result = []
    for row, count in enumerate(held):
        kept = given[row] if keep is None else given[row][keep[row]]
        result.append(bool(np.array_equal(kept, np.arange(count, count + len(kept)))))
    return result


def length_dependent_rope(config) -> list[str]:
    """The rotary (RoPE) types of a model's language model whose frequencies depend on more
    than a token's position (sorted; [] for none, or for a model without RoPE).

    With such a type (``_STATIC_ROPE`` says which are not) a token's KV depends on the length
    of the pass that computed it, and on what the rotary module saw before ("dynamic" keeps
    the longest length seen): the same ids at the same positions give other KV in a longer
    prompt, so that KV must never get content keys. Reads ``rope_parameters`` (or the older
    ``rope_scaling``), flat or per layer type."""
    text = text_config(config)
    params = _field(text, "rope_parameters", None)
    params = _field(text, "rope_scaling", None) if params is None else params
    if not isinstance(params, dict):
        return []
    nested = "rope_type" not in params and "type" not in params
    tables = [table for table in params.values() if isinstance(table, dict)] if nested else [params]
    kinds = {str(table.get("rope_type", table.get("type", "default"))) for table in tables}
    return sorted(kinds - _STATIC_ROPE)


def sliding_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention) as ``transformers`` masks it: the
    config's ``sliding_window`` at layers whose ``layer_types`` entry is "sliding_attention".

    So a ``TieredCache`` can refuse a window at the start of a pass, before its first layer
    stores. A config without ``layer_types`` gives None for every layer: its models (Mistral,
    Phi-3, Starcoder2) slide at every layer or none, so the attention's own check refuses at
    the first layer, before anything is stored. Nor does a config that holds its windows per
    layer (transformers raises for its global ``sliding_window``): each layer's attention checks
    its own window then, as before this check existed."""
    text = text_config(config)
    try:
        types = getattr(text, "layer_types", None) or ()
        window = getattr(text, "sliding_window", None)
    except Exception:  # noqa: BLE001 - a per-layer config (NeoMME) has no one window: the attention checks each layer's
        types, window = (), None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return (None,) * len(types)
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def model_fingerprint(model: torch.nn.Module) -> bytes:
    """16 bytes that tell models apart by what makes their KV: the XXH3-128 hash of the class,
    the language model's config (its JSON, less the fields that only name or date it) and
    every weight and buffer, each by name, shape, dtype and the raw bytes of its values in
    order (``_hash_values``).

    No arithmetic touches the values, so the bytes depend on the values alone, not on torch's
    thread count, the weights' device or the BLAS: the same checkpoint loaded twice, in two
    processes, gets the same bytes; any change of a value, or of where values sit, changes
    them (except by a hash collision).

    Raises:
        UserError: a weight or buffer whose bytes cannot be read (e.g. one on the meta device).
    """
    digest = xxhash.xxh3_128()
    _update_framed(digest, type(model).__name__.encode())
    config = text_config(model.config).to_dict()
    _update_framed(digest, json.dumps({k: v for k, v in config.items() if k not in _UNNAMED}, sort_keys=True,
                                      default=str).encode())
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            _update_framed(digest, f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            _hash_values(digest, name, tensor)
    return digest.digest()


def stamped_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The weights and buffers of ``model``, by name: what ``weights_stamp`` follows. With a
    length-dependent RoPE (``length_dependent_rope``: dynamic, long RoPE...) the
    non-persistent buffers are left out: such a RoPE rewrites its ``inv_freq`` as a sequence
    grows (long RoPE in place at every pass), and such a model's KV is private anyway (never
    keyed, never reused). Every other model's are followed, as ``model_fingerprint`` hashes
    them: a replaced or rewritten ``inv_freq`` changes its KV."""
    named = list(model.named_parameters())
    skip_transient = bool(length_dependent_rope(model.config))
    for prefix, module in model.named_modules():
        transient = getattr(module, "_non_persistent_buffers_set", ()) if skip_transient else ()
        named += [(f"{prefix}.{name}" if prefix else name, buffer) for name, buffer in module._buffers.items()
                  if buffer is not None and name not in transient]
    return named


def tensor_state(tensor: torch.Tensor) -> tuple:
    """A tensor's storage address and version counter, read without its values (None for
    what cannot be read: the address of a tensor without storage, a subclass; the version of
    an inference tensor, which keeps none)."""
    try:
        where = tensor.data_ptr()
    except RuntimeError:  # no storage: its version still tells
        where = None
    try:
        version = tensor._version
    except RuntimeError:  # an inference tensor (made under torch.inference_mode()) tracks no version
        version = None
    return where, version


def weights_stamp(model: torch.nn.Module) -> tuple:
    """What changes whenever torch replaces or changes a weight or persistent buffer, read
    without its values (``stamped_tensors``): each one's name, identity, storage address and
    version counter. ``load_state_dict``, an in-place op on a parameter (a LoRA merge through
    torch), ``model.to`` and a replaced parameter all change it; a write through
    ``tensor.data`` (which has a version counter of its own) or from outside torch (a numpy
    view) does not. O(tensors), no value read: cheap enough to check each time a cache is made
    (``checks.current_fingerprint``)."""
    return tuple((name, id(tensor), *tensor_state(tensor)) for name, tensor in stamped_tensors(model))


def _update_framed(digest, text: bytes) -> None:
    """Adds ``text`` to ``digest`` after its length, so that consecutive fields cannot run
    into each other (the values after a tensor's header have the length its shape and dtype
    give)."""
    digest.update(len(text).to_bytes(8, "little"))
    digest.update(text)


def _hash_values(digest, name: str, tensor: torch.Tensor) -> None:
    """Adds the raw bytes of ``tensor``'s values, in row-major order, to ``digest``, at most
    ``_CHUNK_BYTES`` at a time (``_pieces``: a chunk is copied, at most twice, only when it
    is not contiguous or not on the host; the whole tensor never is).

    Raises:
        UserError: the bytes cannot be read (a meta tensor, a tensor subclass without storage).
    """
    try:
        for piece in _pieces(tensor.detach(), max(1, _CHUNK_BYTES // max(1, tensor.element_size()))):
            digest.update(_row_major(piece).view(torch.uint8).cpu().numpy())
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        raise UserError(f"use_tiercache: cannot read the values of {name} ({tensor.dtype} on {tensor.device}) "
                        f"to fingerprint the model: {exc}") from None


def _pieces(tensor: torch.Tensor, step: int):
    """Views of ``tensor`` that cover its values in row-major order, each of at most ``step``
    values and each contiguous once copied on its own: runs of whole rows of the first
    dimension where a row fits, else each row's own pieces; a 1-D (or contiguous) tensor is
    cut flat. Nothing here copies."""
    if tensor.numel() == 0:
        return
    if tensor.dim() <= 1 or tensor.is_contiguous():
        flat = tensor.reshape(-1)  # a view: 1-D or contiguous
        for start in range(0, flat.numel(), step):
            yield flat[start : start + step]
        return
    row = tensor[0].numel()
    if row > step:
        for index in range(tensor.shape[0]):
            yield from _pieces(tensor[index], step)
        return
    rows = step // row
    for start in range(0, tensor.shape[0], rows):
        yield tensor[start : start + rows]


def _row_major(piece: torch.Tensor) -> torch.Tensor:
    """``piece`` as a contiguous tensor (itself when it is). A column-major 2-D piece (a
    slice of a transposed weight) goes through its transpose: torch copies a slice of a
    transposed matrix value by value (3-4x slower) but a whole transposed matrix fast."""
    if piece.dim() == 2 and not piece.is_contiguous() and piece.stride(0) < piece.stride(1):
        return piece.t().contiguous().t().contiguous()
    return piece.contiguous()


def check_supported(config) -> None:
    """Raises UserError for a model whose cache is not one K and V per KV head per layer of a
    decoder: a latent cache (DeepSeek's multi-head latent attention), layers that share
    another layer's KV (Gemma 3n), layers without attention KV (convolution, linear or state
    space layers of hybrid models), an encoder-decoder model, per-layer or unequal K and V
    head sizes (``_head_dim``), or a model that transforms K or V after the cache update."""
    text = text_config(config)
    if _field(config, "is_encoder_decoder", False):
        raise UserError(f"use_tiercache: {config.model_type} is an encoder-decoder model: not supported")
    if _field(text, "kv_lora_rank", None) is not None:
        raise UserError(f"use_tiercache: {text.model_type} caches a latent (multi-head latent attention, "
                        "kv_lora_rank), not per-head K and V: not supported")
    if _field(text, "num_kv_shared_layers", 0):
        raise UserError(f"use_tiercache: {text.model_type} shares KV between layers (num_kv_shared_layers): not supported")
    others = sorted(set(_field(text, "layer_types", None) or ()) - _ATTENTION_LAYERS)
    if others:
        raise UserError(f"use_tiercache: {text.model_type} has layers other than full or sliding-window attention "
                        f"({', '.join(others)}: layers without attention KV, or attention over chunks): not supported")
    if text.model_type in _KV_AFTER_UPDATE:
        raise UserError(f"use_tiercache: {text.model_type} {_KV_AFTER_UPDATE[text.model_type]}, so its attention "
                        "does not read the K and V the cache stores: not supported")
    heads = _field(text, "num_attention_heads", None)
    if heads and _field(text, "hidden_size", None):
        _head_dim(text, heads, "use_tiercache")


def _head_dim(config, heads: int, where: str) -> int:
    """The head size of a layer's K and of its V: ``head_dim``, else ``hidden_size // heads``.

    Raises:
        UserError: the config holds ``head_dim`` per layer, or gives V heads another size than
            K's (``v_head_dim``, as MiMo-V2-Flash): a layer's K and V are stored in one shape.
    """
    head_dim = _field(config, "head_dim", None, where) or config.hidden_size // heads
    v_head_dim = _field(config, "v_head_dim", None, where)
    if v_head_dim is not None and v_head_dim != head_dim:
        raise UserError(f"{where}: {config.model_type}'s V heads are {v_head_dim} wide and its K heads {head_dim} "
                        "(v_head_dim != head_dim): not supported (K and V are stored with one head size)")
    return head_dim


def _field(config, name: str, default, where: str = "use_tiercache"):
    """A config field, ``default`` when absent; a config that cannot say (transformers raises
    for a field it holds per layer) is refused, naming the field (``where``: the caller)."""
    try:
        return getattr(config, name, default)
    except Exception as exc:  # noqa: BLE001 - e.g. AmbiguousGlobalPerLayerAttributeError
        raise UserError(f"{where}: {config.model_type}'s config cannot give {name} ({exc}): "
                        "not supported") from None


def namespace_bytes(namespace) -> bytes:
    """A namespace as bytes: a str (UTF-8) or bytes.

    Raises:
        UserError: anything else (an int would silently become that many zero bytes).
    """
    if isinstance(namespace, str):
        return namespace.encode()
    if isinstance(namespace, (bytes, bytearray)):
        return bytes(namespace)
    raise UserError(f"TieredCache: namespace must be str or bytes, got {type(namespace).__name__}")


def text_config(config):
    """The language model's config of a (possibly composite, e.g. vision-language) config."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config
