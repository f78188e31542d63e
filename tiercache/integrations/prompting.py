"""A ``TieredCache``'s prompt (``tiercache.integrations.cache``): the rows it starts from
(``prompt=``) and ``generate``'s check of its ids against what those rows know.

Invariant: every row of a cache made with ``prompt=`` starts from the same reused prefix
(whole blocks). The cache's positions (``seq_length``) are row 0's and ``generate`` computes
every row from there, so a row that held more would attend over its extra tokens twice.

Helper functions of ``TieredCache`` (its ``__init__`` and ``check_prompt`` call them): they
read and set the cache's private fields, as its methods would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tiercache.errors import UserError

from .inputs import left_padding, prompt_rows

if TYPE_CHECKING:
    from tiercache.live.sequence import Sequence

    from .cache import TieredCache

__all__ = ["check_ids", "start_rows"]


def start_rows(cache: "TieredCache", prompt, attention_mask) -> None:
    """Opens one sequence per prompt row, every row starting from the same reused prefix: the
    longest that every row has stored (whole blocks, at least one token left to compute), none
    for a padded batch (its rows start at different positions) or a private-KV model.

    A row's sequence may reuse less than the lookup found (another request on the
    ``TieredKVCache`` evicted a block in between; a chunk proved corrupt as its summary was
    read): every row is then cut back to the shortest (``_in_step``).

    Raises:
        UserError: a bad prompt or mask, or a row of the mask that is padding only. A row
            that fails leaves those made before it to ``free()`` or the finalizer.
    """
    rows = prompt_rows(prompt)
    cache._prompt_end = len(rows[0])  # positions, padding included
    rows, padded = _unpadded(cache, rows, attention_mask)
    common = 0 if padded or not cache._ids_decide_kv else _common_prefix(cache, rows)
    for row in rows:
        cache.sequences.append(cache.kv.sequence(tokens=row[: common + 1], namespace=cache.namespace))
    _in_step(cache.sequences, rows)
    cache._pads = np.zeros((len(cache._staged), len(rows)), dtype=np.int64)


def _unpadded(cache: "TieredCache", rows: list[np.ndarray], attention_mask) -> tuple[list[np.ndarray], bool]:
    """The rows without their left padding (recorded in ``cache._prompt_pads``), and whether
    any row had some."""
    if attention_mask is None:
        return rows, False
    keep = left_padding(attention_mask, [len(row) for row in rows])
    if not all(kept.any() for kept in keep):
        raise UserError("TieredCache: a row of the prompt's attention_mask is padding only")
    cache._prompt_pads = [int((~kept).sum()) for kept in keep]
    return [row[kept] for row, kept in zip(rows, keep)], not all(kept.all() for kept in keep)


def _common_prefix(cache: "TieredCache", rows: list[np.ndarray]) -> int:
    """Tokens (whole blocks) every row has stored, leaving each row at least one to compute."""
    block = cache.kv.layout.block_tokens
    return min(min(cache.kv.match_prefix(row, cache.namespace), (len(row) - 1) // block * block) for row in rows)


def _in_step(sequences: "list[Sequence]", rows: list[np.ndarray]) -> None:
    """Cuts every sequence to the shortest reused prefix (``Sequence.crop``: whole blocks, so
    nothing is read), then tells each the rest of its row's ids."""
    reused = min(seq.cached_tokens for seq in sequences)
    for seq, row in zip(sequences, rows):
        if seq.cached_tokens > reused:
            seq.crop(reused)
        seq.add_tokens(row[len(seq.token_ids) :])


def check_ids(cache: "TieredCache", ids: torch.Tensor | None, attention_mask) -> None:
    """``TieredCache.check_prompt``'s check of generate's ids against what each row knows.

    Raises:
        UserError: the ids are not one row per sequence reaching past what the cache holds,
            or a row's ids (padding left out) differ from what it knows; when the rows are a
            beam search's last beams, it says so (they are not what generate returned).
    """
    if ids is None or not cache.sequences:
        return
    try:
        _check_rows(cache, ids, attention_mask)
    except UserError as refused:
        if cache._beam_rows:  # the rows are a beam search's last beams, not what generate returned
            raise UserError(f"TieredCache: its {len(cache.sequences)} rows are the last beams of a beam search, not "
                            "the sequences generate returned; free() it and continue one with TieredCache(kv, "
                            "model, prompt=ids), which reuses its stored blocks") from refused
        raise


def _check_rows(cache: "TieredCache", ids: torch.Tensor, attention_mask) -> None:
    """``check_ids``: one row of ids per sequence, each reaching past what it holds and
    equal to the ids it knows."""
    if ids.dim() != 2 or ids.shape[0] != len(cache.sequences) or ids.shape[1] <= cache.seq_length(0):
        raise UserError(f"TieredCache: generate's ids {tuple(ids.shape)} must be one row per sequence "
                        f"({len(cache.sequences)}) reaching past the {cache.seq_length(0)} positions the cache holds "
                        "(continue from the ids generate returned, or free() the cache to start over)")
    rows = [row.detach().cpu().numpy() for row in ids]
    if attention_mask is not None:
        rows = [row[kept] for row, kept in zip(rows, left_padding(attention_mask, [len(r) for r in rows]))]
    elif cache._prompt_pads is not None:  # generate infers the mask from the pad id: strip the prompt's padding
        rows = [row[pad:] for row, pad in zip(rows, cache._prompt_pads)]
    for index, (row, seq) in enumerate(zip(rows, cache.sequences)):
        known = seq.token_ids
        held = _held_ids(cache)
        if len(row) < len(known):
            raise UserError(f"TieredCache: row {index}: generate's {len(row)} ids are fewer than the {len(known)} "
                            f"{held} ({_continue_hint(cache)})")
        overlap = len(known)
        if not np.array_equal(known, row[:overlap]):
            raise UserError(f"TieredCache: row {index}: generate's ids differ from the {held} "
                            f"({_continue_hint(cache)})")


def _held_ids(cache: "TieredCache") -> str:
    """What a row's known ids are, as the refusals name them."""
    if cache._prompted:
        return "ids of the prompt the cache was made for (prompt=)"
    return "ids the cache holds (its prompt and what generate returned)"


def _continue_hint(cache: "TieredCache") -> str:
    """How to continue, as the refusals say it."""
    if cache._prompted:
        return "give generate the same ids as prompt=, or free() the cache to start over"
    return "continue from the ids generate returned, or free() the cache to start over"
