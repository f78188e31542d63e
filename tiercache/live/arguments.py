"""Checks of the decode API's arguments that several classes share: token ids and a sparse
budget. Each turns what a caller may pass into one plain form, or raises naming what was wrong."""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from tiercache.errors import UserError
from tiercache.keys import _token_array

__all__ = ["flat_token_ids", "sparse_budget_blocks"]


def flat_token_ids(tokens, what: str) -> np.ndarray:
    """Token ids as a flat int64 array: any integer array-like, such as a ``[1, n]``
    ``input_ids`` tensor. Floats, bools and ids beyond int64 raise (TypeError / ValueError
    naming ``what``) instead of hashing a silently converted value."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    try:
        return _token_array(np.asarray(tokens).ravel())
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{what}: {exc}") from None


def sparse_budget_blocks(budget, n_blocks: int) -> int:
    """``Sequence.attend``'s sparse budget as a block count (at least 1): a share (a real in
    (0, 1], of ``n_blocks``, rounded up) or a count (any integer, numpy's too, at least 1).
    Anything else (None, a bool, a string) raises UserError naming its type."""
    if budget is None:
        raise UserError("Sequence.attend: AttentionMode.SPARSE needs a budget (share in (0, 1] or a block count), got None")
    if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, numbers.Real):
        raise UserError("Sequence.attend: a budget must be a share (float in (0, 1]) or a block count (integer), "
                        f"got {type(budget).__name__} {budget!r}")
    if not isinstance(budget, numbers.Integral):
        share = float(budget)
        if not 0.0 < share <= 1.0 or math.isnan(share):
            raise UserError(f"Sequence.attend: a budget share must lie in (0, 1], got {budget}")
        return max(1, math.ceil(share * n_blocks))
    if budget < 1:
        raise UserError(f"Sequence.attend: a budget count must be at least one block, got {budget}")
    return int(budget)
