"""``copy.deepcopy`` of a ``TieredCache``: transformers' recipe for reusing a prompt's cache
(run the shared prompt once, then ``copy.deepcopy`` the cache for each continuation), as with a
``DynamicCache``.

A copy is a second cache over the same ``TieredKVCache`` and model whose rows are forks of the
original's (``Sequence.fork``): every stored block is shared, held once more by the copy, and
only each row's partial tail block is copied, so a copy costs no room in the tiers until it
appends. Everything the cache learnt from its passes (token ids, left padding, the prompt's
end, whether rows were freed) is copied too, so the copy checks and answers ``generate``
exactly as the original would; after the copy each goes its own way (a pass, ``free()`` or
garbage collection of one never changes the other). A copy is made between passes only.
``copy.copy`` (it would share the rows) and pickling stay refused.

The other row operations transformers' decoding modes ask of a cache live here too, each
between passes: ``reorder_rows`` (beam search's reorder, and repeating held rows for several
sequences per prompt: a row used twice is forked) and ``crop_rows`` (speculative decoding's
rollback of rejected drafts: ``Sequence.crop``).

"Between passes" includes after a pass that raised having stored nothing: each operation first
settles it (``TieredCache.settle_failed_pass``), as the next pass would, so a ``crop`` can
give room back after a step that found none. After a pass that stored KV (the cache is out
of step) or while one runs, each is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from tiercache.errors import UserError
from tiercache.live.arguments import integer_or_none

from .release import release_deferred, release_when_dropped

if TYPE_CHECKING:
    from .cache import TieredCache

__all__ = ["crop_rows", "deep_copy", "reorder_rows"]


def deep_copy(cache: "TieredCache", make_layer: Callable) -> "TieredCache":
    """A copy of ``cache`` whose rows hold the same KV (see the module docstring).

    Args:
        cache: the cache to copy, between passes.
        make_layer: the layer class (``TieredLayer``), called as ``make_layer(copy, index)``.

    Raises:
        UserError: the ``TieredKVCache`` is closed; the cache is out of step after a failed
            pass; a pass is running (or one failed after storing KV: ``free()`` the cache).
            Nothing is held then.
    """
    release_deferred()
    if cache.kv._closed:
        raise UserError("TieredCache: its TieredKVCache is closed; a closed cache cannot be copied")
    if cache._broken is not None:
        raise UserError(f"TieredCache: {cache._broken}; it cannot be copied (free() it and start a new one)")
    _between_passes(cache, "a cache is copied")
    twin = object.__new__(type(cache))
    twin.__dict__.update(cache.__dict__)
    twin.layers = [_layer_like(make_layer(twin, index), layer) for index, layer in enumerate(cache.layers)]
    twin._pads = cache._pads.copy()
    twin._prompt_pads = None if cache._prompt_pads is None else list(cache._prompt_pads)
    twin._staged = [None] * len(cache._staged)
    twin._checked_mask = None
    twin.sequences = []  # changed in place, never replaced: its finalizer holds it
    release_when_dropped(twin, twin.sequences)
    try:
        for seq in cache.sequences:
            twin.sequences.append(seq.fork())
    except BaseException:  # an interrupt too: release the forks made so far
        for seq in twin.sequences:
            seq.free()
        twin.sequences.clear()
        raise
    return twin


def _between_passes(cache: "TieredCache", what: str) -> None:
    """Settles a pass that failed having stored nothing (``settle_failed_pass``), then refuses
    (``UserError``) a row operation while a pass is open (running, or failed after storing KV)
    or a finished one left staged KV; ``what`` names the operation in the message ("rows are
    cropped")."""
    cache.settle_failed_pass()
    if cache._open_pass is not None or any(staged is not None for staged in cache._staged):
        raise UserError(f"TieredCache: {what} between passes only (a pass is running, or the last one failed after "
                        "storing KV: free() the cache)")


def _layer_like(layer, original):
    """``layer`` with ``original``'s initialisation (whether a pass has run, on which device)."""
    layer.is_initialized = original.is_initialized
    if hasattr(original, "device"):
        layer.device = original.device
    return layer


def reorder_rows(cache: "TieredCache", order) -> None:
    """Makes row ``i`` go on from row ``order[i]``: beam search's reorder (``reorder_cache``)
    and the expansion of held rows for several sequences per prompt (``order`` repeats each
    row). A row named once moves; each further use is a fork of it (``Sequence.fork``: its
    stored blocks shared, its tail copied); a row not named is freed. Between passes only.

    Raises:
        UserError: ``order`` is not 1-D, holds other than integers (a float or bool index
            would be truncated into other rows), is empty or names a row outside
            ``[0, rows)``, or a pass is running. The rows are unchanged then (forks made
            before an error are freed).
    """
    rows = list(cache.sequences)
    order = _row_order(order)
    if not order or any(not 0 <= i < len(rows) for i in order):
        raise UserError(f"TieredCache: row order {order} for a cache of {len(rows)} rows")
    _between_passes(cache, "rows are reordered")
    moved: set[int] = set()
    result, forks = [], []
    try:
        for index in order:
            if index in moved:
                forks.append(rows[index].fork())
                result.append(forks[-1])
            else:
                moved.add(index)
                result.append(rows[index])
    except BaseException:  # an interrupt too: no fork outlives the failed call
        for seq in forks:
            seq.free()
        raise
    cache.sequences[:] = result
    cache._pads = cache._pads[:, order]
    if cache._prompt_pads is not None:
        cache._prompt_pads = [cache._prompt_pads[i] for i in order]
    cache._checked_mask = None
    for index, seq in enumerate(rows):
        if index not in moved:
            seq.free()


def _row_order(order) -> list[int]:
    """``order`` (a tensor, array or list of row indices) as a list of ints.

    Raises:
        UserError: ``order`` is not 1-D, or its values are not integers (bools and floats
            refused, as transformers' ``index_select`` refuses them; a bool among the ints of a
            list or tuple too, which numpy would read as 0 or 1), each named.
    """
    if isinstance(order, (list, tuple)):
        _refuse_bools(order)
    if isinstance(order, torch.Tensor):
        if order.dtype == torch.bool or order.dtype.is_floating_point or order.dtype.is_complex:
            raise UserError(f"TieredCache: row order must hold integer row indices, got dtype {order.dtype}")
        order = order.detach().cpu().numpy()
    try:
        array = np.asarray(order)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise UserError(f"TieredCache: row order must be a 1-D sequence of integer row indices ({exc})") from None
    if array.ndim != 1:
        raise UserError(f"TieredCache: row order must be 1-D (one source row per row), got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise UserError(f"TieredCache: row order must hold integer row indices, got dtype {array.dtype}")
    return [int(i) for i in array]


def _refuse_bools(order: list | tuple) -> None:
    """Raises UserError naming the first bool (Python's, numpy's, or a one-value bool tensor or
    array) among the integers of ``order``, which numpy would read as row 0 or 1 (all bools
    read as dtype bool, which ``_row_order`` names)."""
    bools = [_is_bool(value) for value in order]
    if any(bools) and not all(bools):
        position = bools.index(True)
        raise UserError(f"TieredCache: row order must hold integer row indices, got a bool ({order[position]!r}) at "
                        f"position {position}")


def _is_bool(value) -> bool:
    """Whether ``value`` is a bool, numpy's, or a bool tensor or array."""
    return (isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)
            or (isinstance(value, np.ndarray) and value.dtype == np.bool_))


def crop_rows(cache: "TieredCache", tokens_to_remove) -> None:
    """transformers' ``crop``: drops the last ``-tokens_to_remove`` positions of every row
    (``Sequence.crop``: blocks wholly past the cut are released and stay stored, the rest of
    the cut block becomes the tail, the dropped ids are forgotten). Between passes only.

    Raises:
        UserError: not a non-positive integer (transformers' crop takes the tokens to remove
            as a negative number), more tokens than a row holds, or a pass is running; no
            row changes then.
    """
    count = integer_or_none(tokens_to_remove)
    if count is None or count > 0:
        raise UserError(f"TieredCache.crop: give the tokens to remove as a negative integer, got {tokens_to_remove!r}")
    _between_passes(cache, "rows are cropped")
    lengths = [seq.length(0) for seq in cache.sequences]
    short = next((row for row, length in enumerate(lengths) if length < -count), None)
    if short is not None:
        pads = int(cache._pads[0][short]) if cache.sequences else 0
        padded = f" after {pads} positions of left padding, which crop cannot remove" if pads else ""
        raise UserError(f"TieredCache.crop: {-count} tokens to remove, but row {short} holds {lengths[short]}{padded}")
    if count:
        for seq, length in zip(cache.sequences, lengths):
            seq.crop(length + count)
        cache._checked_mask = None
