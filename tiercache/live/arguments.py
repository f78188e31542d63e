"""Checks of the live API's arguments: token ids, a sparse budget, appended KV and queries of
the decode API, and the store's flags. Each turns what a caller may pass into one plain form,
or raises naming what was wrong."""

from __future__ import annotations

import math
import numbers
import operator

import numpy as np
import torch

from tiercache.config import AttentionMode
from tiercache.data.buffers import check_quantisable
from tiercache.errors import UserError
from tiercache.keys import _token_array, refuse_listed_bools

__all__ = ["flat_token_ids", "sparse_budget_blocks", "attend_blocks", "check_kv", "check_query", "check_flag", "integer_or_none"]


def flat_token_ids(tokens, what: str) -> np.ndarray:
    """One sequence's token ids as a flat int64 array: any integer array-like of shape
    ``[n]`` or ``[1, n]`` (an ``input_ids`` tensor of one row), or a list or tuple of one-id
    tensors or arrays (a decode loop's per-step ``argmax`` ids, each ``[1]`` or ``[1, 1]``),
    taken in order. Floats, bools and ids beyond int64 raise (TypeError / ValueError naming
    ``what``) instead of hashing a silently converted value.

    Raises:
        UserError: a batch (``[b, n]`` with ``b > 1``, or more than two dimensions), whose
            rows would otherwise be run together into one sequence; an ``[n, 1]`` array,
            tensor or nested list (``n > 1``) is n rows of one token, and its message says so.
    """
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    try:
        refuse_listed_bools(tokens)
        array = _per_step_ids(tokens)
        array = np.asarray(tokens) if array is None else array
        if array.ndim > 2 or (array.ndim == 2 and array.shape[0] != 1):
            raise UserError(_not_one_sequence(what, array.shape))
        if array.ndim == 2:
            return _token_array(array[0], array.shape)  # an error names the shape given
        return _token_array(array)  # a 0-d array keeps its shape in the error
    except UserError:
        raise
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{what}: {exc}") from None


def _per_step_ids(tokens) -> np.ndarray | None:
    """A list or tuple of tensors or arrays of one id each, not all 0-d (a decode loop's
    per-step ids), as a 1-D object array of those ids (``_token_array`` checks their range);
    None for anything else, which numpy reads as it is.

    Raises:
        TypeError: such an element holds no integer (a float or bool id).
    """
    if not isinstance(tokens, (list, tuple)) or not tokens:
        return None
    if not all(isinstance(t, (torch.Tensor, np.ndarray)) for t in tokens):
        return None
    parts = [t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t for t in tokens]
    if any(p.size != 1 for p in parts) or all(p.ndim == 0 for p in parts):
        return None  # rows of a batch; or 0-d ids, which numpy already stacks into [n]
    kind = next((p.dtype for p in parts if p.dtype.kind not in "iu"), None)
    if kind is not None:
        raise TypeError(f"token_ids must be integers, got a one-id element of dtype {kind}")
    return np.array([p.item() for p in parts], dtype=object)


def _not_one_sequence(what: str, shape: tuple[int, ...]) -> str:
    """The message for ids of ``shape`` that are not one sequence; an ``[n, 1]`` column is
    named as what it reads as, n rows of one token, with the way to give one sequence."""
    head = f"{what}: one sequence's ids ([n] or [1, n]) expected, got shape {shape}"
    if len(shape) == 2 and shape[1] == 1:
        return (f"{head}: an [n, 1] column reads as n rows of one token each; if it is one sequence, flatten it "
                "(ids.ravel(), ids.view(-1), torch.cat of the per-step ids), else give each row on its own")
    return f"{head}: give each row of a batch on its own"


def sparse_budget_blocks(budget, n_blocks: int, what: str = "Sequence.attend") -> int:
    """A sparse budget as a block count (at least 1): a share (a real in (0, 1], of
    ``n_blocks``, rounded up) or a count (any integer, numpy's too, at least 1). Anything else
    (None, a bool, a string) raises UserError naming ``what`` (the call) and its type."""
    if budget is None:
        raise UserError(f"{what}: AttentionMode.SPARSE needs a budget (share in (0, 1] or a block count), got None")
    if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, numbers.Real):
        raise UserError(f"{what}: a budget must be a share (float in (0, 1]) or a block count (integer), "
                        f"got {type(budget).__name__} {budget!r}")
    if not isinstance(budget, numbers.Integral):
        share = float(budget)
        if not 0.0 < share <= 1.0 or math.isnan(share):
            raise UserError(f"{what}: a budget share must lie in (0, 1], got {budget}")
        return max(1, math.ceil(share * n_blocks))
    if budget < 1:
        raise UserError(f"{what}: a budget count must be at least one block, got {budget}")
    return int(budget)


def attend_blocks(mode, budget, n_blocks: int, what: str) -> int | None:
    """The blocks a decode step of ``mode`` reads of ``n_blocks``: None for
    ``AttentionMode.EXACT`` (every block; no budget allowed), the budget as a count
    (``sparse_budget_blocks``) for ``AttentionMode.SPARSE``. Changes nothing, so a caller
    checks every argument with it before a step takes a step number.

    Raises:
        UserError: ``mode`` is not an ``AttentionMode``, a budget in exact mode, a bad or
            missing budget in sparse mode (each naming ``what``).
    """
    if not isinstance(mode, AttentionMode):
        raise UserError(f"{what}: mode must be an AttentionMode (EXACT or SPARSE), got {mode!r}")
    if mode is AttentionMode.EXACT:
        if budget is not None:
            raise UserError(f"{what}: budget applies to AttentionMode.SPARSE only")
        return None
    return sparse_budget_blocks(budget, n_blocks, what)


def _check_strided(x: torch.Tensor, what: str) -> None:
    """Raises UserError naming ``what`` unless ``x`` is a dense tensor (a sparse or mkldnn
    one cannot be sliced, stacked or copied into a block)."""
    if x.layout != torch.strided:
        raise UserError(f"{what} must be a dense (strided) tensor, got layout {x.layout}")


def check_kv(cache, x: torch.Tensor, name: str) -> None:
    """Raises UserError unless ``x`` is KV that ``Sequence.append`` of ``cache`` (a
    ``TieredKVCache``) can store: ``[kv_heads, t >= 1, head_dim]`` in the layout's dtype, on
    the HBM tier's device, dense (strided), and within a quantised tier's range."""
    layout = cache.layout
    if not isinstance(x, torch.Tensor):
        raise UserError(f"Sequence.append: {name} must be a torch.Tensor, got {type(x).__name__}")
    _check_strided(x, f"Sequence.append: {name}")
    if x.dim() != 3 or x.shape[0] != layout.kv_heads or x.shape[2] != layout.head_dim or x.shape[1] < 1:
        raise UserError(f"Sequence.append: {name} must be [kv_heads={layout.kv_heads}, t>=1, head_dim={layout.head_dim}], "
                        f"got {tuple(x.shape)}")
    if x.dtype != cache.dtype:
        raise UserError(f"Sequence.append: {name} must be {cache.dtype} (the layout's dtype), got {x.dtype}")
    if x.device != cache.device:
        raise UserError(f"Sequence.append: {name} must be on {cache.device} (the HBM tier's device), got {x.device}")
    if cache.store.value_limit is not None:
        check_quantisable(x, f"Sequence.append: {name}", cache.store.value_limit, unit="appended token", dim=1)


def check_query(cache, q: torch.Tensor, what: str, one_token: bool) -> None:
    """Raises UserError unless ``q`` is ``[q_heads, t, head_dim]`` (``t == 1`` when
    ``one_token``, else ``t >= 1``) with ``q_heads`` a positive multiple of the layout's
    ``kv_heads``, dense (strided), in the layout's dtype, on the HBM tier's device."""
    layout = cache.layout
    if not isinstance(q, torch.Tensor):
        raise UserError(f"{what}: q must be a torch.Tensor, got {type(q).__name__}")
    _check_strided(q, f"{what}: q")
    tokens = "1" if one_token else "t>=1"
    if (q.dim() != 3 or q.shape[2] != layout.head_dim or q.shape[0] < 1 or q.shape[0] % layout.kv_heads
            or q.shape[1] < 1 or (one_token and q.shape[1] != 1)):
        raise UserError(f"{what}: q must be [q_heads (a multiple of kv_heads={layout.kv_heads}), {tokens}, "
                        f"head_dim={layout.head_dim}], got {tuple(q.shape)}")
    if not q.dtype.is_floating_point:
        raise UserError(f"{what}: q must be a float tensor, got {q.dtype}")
    if q.dtype != cache.dtype:
        raise UserError(f"{what}: q must be {cache.dtype} (the layout's dtype), got {q.dtype}")
    if q.device != cache.device:
        raise UserError(f"{what}: q must be on {cache.device} (the HBM tier's device), got {q.device}")


def prompt_tokens(token_ids, namespace, what: str) -> np.ndarray:
    """``flat_token_ids`` of ``token_ids``, once ``namespace`` is checked to be bytes or str
    as the prompt-key functions take it (``keys.prefix_keys``).

    Raises:
        TypeError: naming ``what`` (the call), for another namespace; as ``flat_token_ids``.
    """
    if not isinstance(namespace, (bytes, bytearray, str)):
        raise TypeError(f"{what}: namespace must be bytes or str, got {type(namespace).__name__}")
    return flat_token_ids(token_ids, what)


def check_flag(value, what: str) -> None:
    """Raises UserError naming ``what`` unless ``value`` is a bool (numpy's too): a flag such
    as ``wait="no"`` would otherwise be taken as true."""
    if not isinstance(value, (bool, np.bool_)):
        raise UserError(f"{what} must be True or False, got {type(value).__name__} {value!r}")


def integer_or_none(value) -> int | None:
    """``value`` as an int when it is an integer (``operator.index``: a numpy integer, a 0-d
    integer tensor too), not a bool of any kind; else None."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and (value.dim() or value.dtype == torch.bool)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
