"""``TieredCache``: the ``transformers`` ``Cache`` over a ``TieredKVCache`` (see
``tiercache.integrations.transformers`` for the whole picture and the entry points).

A forward pass, as the cache sees it: ``begin_pass`` (the model's forward pre-hook: checks the
pass, learns its token ids, decides whether its KV may get content keys), then per layer
``_stage`` (the layer's ``update``) and ``attend`` (the ``"tiercache"`` attention), then
``end_pass`` (the forward hook). A pass that raised anywhere is found at the next
``begin_pass`` (or at a row operation between passes: ``crop``, ``reorder_cache``, a deep
copy): if it stored nothing, what it learnt is undone; if it stored KV at some layers, the
layers are out of step and the cache refuses every later pass (``free`` it). So a refusal
comes before a pass's first layer stores: a sliding window that any layer would outgrow is
refused at ``begin_pass``.
"""

from __future__ import annotations

from tiercache.extras import require

require("torch", "transformers", what="tiercache.integrations (the transformers cache)")

import math
import weakref
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache

from tiercache.attention import Partial, compute_dtype, merge
from tiercache.config import AttentionMode
from tiercache.errors import UserError
from tiercache.live.cache import TieredKVCache
from tiercache.live.sequence import Sequence

from .causal import causal_partial, expected_mask
from .checks import (ATTENTION, FINGERPRINT, check_decoding, check_mode, check_model, check_windows_fit,
                     current_fingerprint, fingerprint_of_pass, first_position, kept_columns, pass_tokens)
from .copying import crop_rows, deep_copy, reorder_rows
from .hooks import TIERED_CACHE, decoder_of
from .layer import TieredLayer
from .inputs import length_dependent_rope, namespace_bytes, other_inputs, sliding_windows, standard_positions
from .prompting import check_ids, start_rows
from .release import release_deferred, release_when_dropped

__all__ = ["ATTENTION", "TieredCache", "FINGERPRINT"]

# generate's tensor arguments that are ids, masks or positions (any other tensor is an input
# the KV may depend on: embeddings, images, audio).
_GENERATE_IDS = frozenset({"input_ids", "inputs", "attention_mask", "position_ids", "negative_prompt_ids",
                           "negative_prompt_attention_mask"})


class TieredCache(Cache):
    """A ``transformers`` cache whose KV lives in a ``TieredKVCache``.

    Args:
        kv: the tiered cache (its layout must match the model: ``kv_layout``).
        model: the model, switched with ``use_tiercache(model)``; its weights' fingerprint
            is part of every content key, so models with other weights never share KV.
        mode: attention of decode steps (a one-token pass past the prompt: ``generate``'s
            ids, or ``prompt=``): ``AttentionMode.EXACT`` or ``SPARSE``; the prompt's own
            passes are always exact.
        budget: sparse only: blocks each decode step reads (``Sequence.attend``'s budget).
        prompt: the prompt's token ids (``[batch, n]``): each row starts from the longest
            prefix that every row has stored (whole blocks, at least one token left to
            compute), and the prompt's blocks get content keys a later prompt finds. Give
            ``generate`` the same ids (it checks them): it computes only from
            ``get_seq_length()`` on. A model whose RoPE depends on the pass's length
            (``inputs.length_dependent_rope``: "dynamic", "longrope") keeps all its KV
            private: its prompts reuse and store no prefix.
        attention_mask: the prompt's ``[batch, n]`` mask (0: left padding), as given to
            ``generate``: padding ids are not tokens of the row; a padded batch reuses no
            stored prefix (its rows would start at different positions).
        namespace: keeps prefixes apart beyond the weights (an adapter, a tenant).

    A cache serves the model it was made for only: a pass by another model's decoder, or
    after its weights changed (``checks.fingerprint_of_pass``), is refused (its KV would be keyed by the
    fingerprint the cache was made with). A cache dropped without ``free()`` releases its
    rows when it is garbage-collected (``release``). ``copy.deepcopy`` makes a second cache
    with its rows' KV (``copying``); it cannot be shallow-copied or pickled.

    Raises:
        UserError: ``kv`` is closed; the model is not switched (``use_tiercache``); the
            layout or dtype does not match the model; a bad mode, budget, prompt or mask.
    """

    def __init__(self, kv: TieredKVCache, model: Any, mode: AttentionMode = AttentionMode.EXACT,
                 budget: float | int | None = None, prompt=None, attention_mask=None,
                 namespace: bytes | str = b"") -> None:
        check_model(kv, model)
        check_mode(mode, budget)
        release_deferred()
        super().__init__(layers=[TieredLayer(self, layer) for layer in range(kv.layout.layers)])
        self.kv, self.mode, self.budget = kv, mode, budget
        # the model it serves, by reference only (a cache does not keep a model alive)
        self._model, self._decoder = weakref.ref(model), weakref.ref(decoder_of(model))
        self._fingerprint = current_fingerprint(model)  # anew if the weights changed since
        self.namespace = self._fingerprint + namespace_bytes(namespace)
        # False for a RoPE whose KV depends on the pass's length: every row's KV is private
        self._ids_decide_kv = not length_dependent_rope(model.config)
        self._windows = sliding_windows(model.config)  # per layer: its sliding window, None: full attention
        self.sequences: list[Sequence] = []  # changed in place, never replaced: its finalizer holds it
        release_when_dropped(self, self.sequences)
        self._prompt_end = 0  # positions generate's (or prompt='s) ids reach: a pass before it is no decode step
        self._decoding = False  # the running pass is a decode step (the cache's mode applies)
        self._freed_rows = False  # free() released rows since the last generate began
        self._staged: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * kv.layout.layers
        self._checked_mask: tuple | None = None  # (mask, held, tokens) last found as expected
        self._pads = np.zeros((kv.layout.layers, 0), dtype=np.int64)  # [layer, row]: padding not stored
        self._pass: tuple[int, torch.Tensor] | None = None  # (start, kept columns [batch, t]) of a padded pass
        self._open_pass: list[int] | None = None  # token ids each row knew when the running pass began
        self._pass_start = 0  # positions every layer had passed when the running pass began
        self._opened_in_pass = False
        self._prompt_pads: list[int] | None = None  # each prompt row's left padding, when prompt= had a mask
        self._broken: str | None = None
        self._expand = 1  # rows generate makes of each held row (check_prompt), done at its first pass
        self._expanded = 1  # rows the running pass made of each (undone if it fails having stored nothing)
        self._beam_rows = False  # the rows are a beam search's beams (reorder_cache), not generate's returns
        self._prompted = prompt is not None  # the rows hold prompt='s ids, no generate has passed them yet
        if prompt is not None:
            start_rows(self, prompt, attention_mask)
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
        the policies evict them); the cache starts empty again. Idempotent: a second call (or
        ``reset``, which frees once per layer) keeps the first one's mark, so the next step of
        the same generation is still refused. (A cache dropped without it releases them when
        garbage-collected.)"""
        freed = bool(self.sequences)
        self._clear()
        self._freed_rows = self._freed_rows or freed

    def __deepcopy__(self, memo: dict) -> "TieredCache":
        """A second cache whose rows hold this one's KV so far (``copying``: blocks shared, the
        rows' tails copied); made between passes only."""
        twin = deep_copy(self, TieredLayer)
        memo[id(self)] = twin
        return twin

    def __reduce_ex__(self, protocol):
        raise UserError("TieredCache: a cache cannot be shallow-copied or pickled (its rows hold blocks of a "
                        "TieredKVCache); copy.deepcopy(cache) makes a second cache with its KV, and a new "
                        "TieredCache(kv, model, prompt=ids) starts from the stored prefix")

    # -- a forward pass ------------------------------------------------------------------
    def begin_pass(self, module: torch.nn.Module, ids: torch.Tensor | None, kwargs: dict) -> None:
        """The model's forward pre-hook: checks the pass, then tells each row the ids of its
        kept (not padding) new tokens, or, when the pass's KV depends on more than ids at
        their standard positions (embeddings, an image, a length-dependent RoPE), makes the
        rows' KV private from here on.

        A one-token pass past the prompt (``generate``'s ids, or ``prompt=``) is a decode
        step, read in the cache's mode; every other pass is exact.

        Raises:
            UserError: the cache is out of step after a failed pass; a pass by another model
                than the cache's, or after its weights changed; attention
                weights asked for; ids that differ from the prompt; padding other than left
                padding; custom positions over a reused prefix; a sliding window (of any
                layer) that the sequence outgrows.
        """
        release_deferred()
        self._recover()
        self._check_model_of(module)
        if kwargs.get("output_attentions"):
            raise UserError("TieredCache: output_attentions is not supported (attention weights are never formed)")
        if module.training:
            raise UserError("TieredCache: the model is in training mode (dropout would change the KV it stores); "
                            "call model.eval()")
        tokens = pass_tokens(ids, kwargs)
        self._expand_rows(tokens)
        if tokens.dim() < 2 or (self.sequences and tokens.shape[0] != len(self.sequences)):
            raise UserError(f"TieredCache: inputs of shape {tuple(tokens.shape)} for a cache of {len(self.sequences)} rows")
        batch, count, start = tokens.shape[0], tokens.shape[1], self.seq_length(0)
        for layer, window in enumerate(self._windows):  # a later layer's refusal, before layer 0 stores
            self.check_window(layer, count, window)
        held = [seq.length(0) for seq in self.sequences] or [0] * batch
        pads = self._pads[0] if self.sequences else np.zeros(batch, dtype=np.int64)
        mask = kwargs.get("attention_mask")
        if mask is None and pads.any():
            raise UserError("TieredCache: rows hold left padding, so every pass needs the attention mask "
                            "(without one the padding would be attended)")
        keep = kept_columns(mask, start, count, held, pads)
        positioned = standard_positions(kwargs.get("position_ids"), keep, held, start, count)
        self._check_positions(kwargs.get("position_ids"), positioned, keep, held, pads, count)
        self._decoding = count == 1 and start >= self._prompt_end  # one token past the prompt
        self._opened_in_pass = not self.sequences
        if self._opened_in_pass:
            self._open(batch)
        keyed = self._ids_decide_kv and ids is not None and not other_inputs(kwargs)
        new_ids = [self._new_ids(row, ids, keep) if keyed and positioned[row] else None for row in range(batch)]
        self._open_pass, self._pass_start = [len(seq.token_ids) for seq in self.sequences], start
        self._pass = None if keep is None else (start, torch.as_tensor(keep, device=self.kv.device))
        for seq, given, before in zip(self.sequences, new_ids, held):
            if given is None and len(seq.token_ids) > before:  # this pass's KV gets private keys
                seq.forget_tokens(before, private=False)  # taken back: rows holding more KV than ids key nothing
            elif given is not None and len(given):
                seq.add_tokens(given)

    def end_pass(self) -> None:
        """The model's forward hook: the pass finished."""
        self._open_pass, self._expanded = None, 1
        self._prompted = False  # the rows now hold what a generate computed past prompt='s ids

    def crop(self, tokens_to_remove: int) -> None:
        """Drops every row's last ``-tokens_to_remove`` positions (rejected drafts; ``crop_rows``)."""
        crop_rows(self, tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search's reorder between steps: row ``i`` goes on from row ``beam_idx[i]``
        (``copying.reorder_rows``: a row kept by several beams is forked, one kept by none
        is freed)."""
        reorder_rows(self, beam_idx)
        self._beam_rows = True

    def _expand_rows(self, tokens: torch.Tensor) -> None:
        """At a generate's first pass over held rows (``prompt=``, or a continued cache) with
        ``num_beams`` or ``num_return_sequences`` above 1, repeats each row as transformers
        repeated its ids (forks); a first pass that fails having stored nothing undoes it."""
        factor, self._expand = self._expand, 1
        if factor > 1 and self.sequences and tokens.dim() >= 2 and tokens.shape[0] == len(self.sequences) * factor:
            reorder_rows(self, [row for row in range(len(self.sequences)) for _ in range(factor)])
            self._expanded = factor

    def check_prompt(self, ids: torch.Tensor | None, attention_mask, kwargs: dict) -> None:
        """``generate``'s check of its inputs against what the cache holds (only the ids from
        ``seq_length()`` on reach the forward passes: a differing id before that, or inputs
        other than ids, would be answered from KV computed for other inputs).

        Raises:
            UserError: a row's ids (padding left out) differ from what the row knows; the ids
                do not reach past what the cache holds; embeddings or other model inputs
                given while the rows hold reused KV; a decoding mode that selects rows or drafts
                through the model's layers (constrained beam search, contrastive search...), a
                speculative one on held rows, classifier-free guidance or ``use_cache=False``,
                in generate's keyword arguments or its generation config, refused before any
                pass runs (``check_decoding``).
        """
        self._recover()
        factor = check_decoding(kwargs, self._model(), holds_rows=bool(self.sequences))
        self._expand = factor if self.sequences else 1
        others = sorted(name for name, value in kwargs.items()
                        if isinstance(value, torch.Tensor) and name not in _GENERATE_IDS)
        if others and self.cached_tokens:
            raise UserError(f"TieredCache: {', '.join(others)} given with a reused prefix computed from ids alone; "
                            "make the cache without prompt= for such inputs")
        check_ids(self, ids, attention_mask)
        prompt = ids if ids is not None else kwargs.get("inputs_embeds")
        self._prompt_end = prompt.shape[1] if isinstance(prompt, torch.Tensor) and prompt.dim() >= 2 else 0
        check_windows_fit(kwargs, self._model(), self._prompt_end, ids is not None, self._windows)
        self._freed_rows = False  # a new generate: a free() before it was not during generation

    def attend(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The ``"tiercache"`` attention of ``layer`` (see ``tiercache_attention``)."""
        with torch.no_grad():
            return self._attend(layer, query, scaling)

    def check_window(self, layer: int, tokens: int, window: int | None) -> None:
        """Raises UserError once a sliding window would cut the sequence (until then a
        sliding-window layer attends to everything, as full attention does)."""
        if window is not None and self.seq_length(layer) + tokens > window:
            raise UserError(f"TieredCache: sliding_window={window} is not supported once the sequence outgrows it "
                            f"({self.seq_length(layer) + tokens} positions)")

    def check_mask(self, mask: torch.Tensor | None, layer: int, tokens: int) -> None:
        """Raises UserError unless ``mask`` lets every (non-padding) query see what the cache
        gives it: the row's held positions after its left padding, and the pass's kept tokens
        causally (``causal.expected_mask``). Padding queries' rows are not compared: their
        output is thrown away."""
        held = self.seq_length(layer)
        checked = self._checked_mask
        if mask is None or (checked is not None and checked[0] is mask and checked[1:] == (held, tokens)):
            return
        keep = self._keep(layer, tokens)
        allowed = mask if mask.dtype == torch.bool else mask == 0
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
        self._checked_mask = (mask, held, tokens)

    # -- inside a pass -------------------------------------------------------------------
    def settle_failed_pass(self) -> None:
        """Between passes (``copying``'s row operations call it): undoes what a pass that
        raised having stored nothing had learnt, as the next pass's ``_recover`` would, so that
        ``crop`` can give room back after a pass that found none. A cache out of step (a pass
        that stored KV, or one still running after storing) is left as it is: the row
        operation refuses it."""
        if self._broken is None and not self.kv._closed and self._out_of_step() is None:
            self._undo_failed_pass()

    def _recover(self) -> None:
        """Before a pass: refuses a cache left out of step, and undoes what a pass that
        raised before storing anything had learnt."""
        if self.kv._closed:
            raise UserError("TieredCache: its TieredKVCache is closed")
        self._broken = self._broken or self._out_of_step()
        if self._broken is not None:
            raise UserError(f"TieredCache: {self._broken}; free() it and start a new one")
        self._undo_failed_pass()

    def _out_of_step(self) -> str | None:
        """Why the rows cannot go on after the last pass; None when they can (it finished, or
        it raised before any layer stored)."""
        if self._open_pass is None and any(staged is not None for staged in self._staged):
            return (f"a finished pass left new KV unread: the model's attention is not {ATTENTION!r} "
                    "(call use_tiercache(model))")
        if self._open_pass is not None and self.seq_length(0) != self._pass_start:
            return "a pass failed after storing its KV (its output was lost)"
        if len({self.seq_length(layer) for layer in range(len(self._staged))}) > 1:
            return "its layers hold different lengths (a pass failed after storing some layers)"
        return None

    def _undo_failed_pass(self) -> None:
        """Forgets what a pass that raised before storing anything had learnt: its rows' new
        ids, the rows it opened, its staged KV, the rows it repeated (nothing after a pass that
        finished). Only when ``_out_of_step`` found nothing."""
        if self._open_pass is not None:
            for seq, known in zip(self.sequences, self._open_pass):
                if len(seq.token_ids) > known:
                    seq.forget_tokens(known, private=False)
            if self._opened_in_pass:  # and the rows it opened (the next pass may have another batch)
                self._clear()
        self._staged = [None] * len(self._staged)
        self._open_pass = None
        factor, self._expanded = self._expanded, 1
        if factor > 1:  # a failed or refused first pass: undo its repeated rows (groups hold one KV)
            reorder_rows(self, list(range(0, len(self.sequences), factor)))

    def _check_model_of(self, module: torch.nn.Module) -> None:
        """Raises UserError unless ``module`` is the decoder of the model this cache was made
        for, with the weights fingerprint the cache's content keys include."""
        if module is not self._decoder():
            raise UserError(f"TieredCache: a pass by a {type(module).__name__} that is not the decoder of the model "
                            "this cache was made for (its KV would be keyed by that model's weights); make a "
                            "TieredCache(kv, model) for each model")
        model = self._model()
        if model is not None and fingerprint_of_pass(model) != self._fingerprint:
            raise UserError("TieredCache: the model's weights changed: tiercache found other weights since this cache was "
                            "made (its KV and keys are the old weights'); free() it and make a new TieredCache")

    def _check_positions(self, position_ids, positioned: list[bool], keep, held: list[int], pads: np.ndarray,
                         count: int) -> None:
        """Raises UserError for position_ids the rows' KV cannot follow: custom ones over a
        reused prefix (computed at the standard positions), ones starting past 0 on a cache
        freed during generation, or ones starting inside what the cache holds."""
        start = self.seq_length(0)
        if self.cached_tokens and start == self.cached_tokens and not all(positioned):
            raise UserError(f"TieredCache: custom position_ids over a reused prefix (its {self.cached_tokens} tokens' "
                            "KV was computed at the standard positions); make the cache without prompt= for them")
        first = first_position(position_ids, count)
        if not any(held) and not pads.any() and first > 0 and self._freed_rows:
            raise UserError("TieredCache: the cache holds no tokens but the pass's position_ids start past 0 "
                            "(was it freed during generation?)")
        if any(held) and not pads.any() and keep is None and position_ids is not None and first < start:
            raise UserError(f"TieredCache: the pass's position_ids start at {first}, inside the {start} positions the "
                            "cache holds (use_cache=False with a cache, or the same tokens fed twice?)")

    def _new_ids(self, row: int, ids: torch.Tensor, keep: np.ndarray | None) -> np.ndarray | None:
        """The ids of a row's kept new tokens that its sequence does not know yet, after
        checking those it knows; None when the row's ids stopped being known (a pass
        without them came first: its later blocks stay private)."""
        seq = self.sequences[row]
        given = ids[row].detach().cpu().numpy()
        given = given if keep is None else given[keep[row]]
        known, held = seq.token_ids, seq.length(0)
        if len(known) < held:
            return None
        overlap = min(len(known) - held, len(given))
        if not np.array_equal(known[held : held + overlap], given[:overlap]):
            raise UserError(f"TieredCache: row {row}: the input ids of tokens {held}..{held + overlap - 1} differ "
                            "from the prompt the cache was made for (pass generate the same ids; a left-padded "
                            "prompt= needs its attention_mask= too)")
        return given[overlap:]

    def _stage(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._open_pass is None:
            raise UserError("TieredCache: a layer ran without the pass's hooks (call the model readied by "
                            "use_tiercache, or its decoder, with the cache)")
        if self._staged[layer] is not None or self._broken is not None:
            self._broken = self._broken or "a layer's new KV was never read by the tiercache attention"
            raise UserError("TieredCache: the model's attention did not read the tiered KV (its attention "
                            f"implementation is not {ATTENTION!r}: call use_tiercache(model)), or an earlier pass "
                            "failed; free() the cache and start a new one")
        if k.shape[0] != len(self.sequences):
            raise UserError(f"TieredCache: batch of {k.shape[0]} rows, but the cache holds {len(self.sequences)} sequences")
        self._staged[layer] = (k, v)

    def _attend(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of ``query`` (``[batch, heads, t, D]``) over each row's held tokens and
        the staged new ones; appends the staged tokens. Returns ``[batch, t, heads, D]``, contiguous."""
        k_new, v_new = self._staged[layer]
        self._staged[layer] = None
        batch, heads, tokens, head_dim = query.shape
        factor = scaling * math.sqrt(head_dim)
        q = (query if math.isclose(factor, 1.0) else query * factor).to(self.kv.dtype)
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
        return torch.stack(outs).transpose(1, 2).contiguous().to(query.dtype)  # contiguous, as transformers' own

    def _keep(self, layer: int, tokens: int) -> torch.Tensor | None:
        """The kept (not padding) columns of this pass (``[batch, t]``), None: all of them."""
        if self._pass is None:
            return None
        start, keep = self._pass
        return keep if start == self.seq_length(layer) and keep.shape[1] == tokens else None

    def _decode_partial(self, seq: Sequence, layer: int, q: torch.Tensor) -> Partial:
        """One query's attention over everything its sequence holds at ``layer`` (the new
        token included): in the cache's mode for a decode step (exact while no block is
        full), exact for a one-token pass of the prompt."""
        if self._decoding and self.mode is AttentionMode.SPARSE and seq.blocks(layer) > 0:
            return seq.attend_partial(layer, q, AttentionMode.SPARSE, self.budget)
        return seq.attend_partial(layer, q)

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

    # -- starting -------------------------------------------------------------------------
    def _open(self, rows: int) -> None:
        """Empty sequences for a batch of ``rows`` (no prompt given)."""
        self.sequences[:] = [self.kv.sequence(namespace=self.namespace) for _ in range(rows)]
        self._pads = np.zeros((len(self._staged), rows), dtype=np.int64)
        self._freed_rows = False

    def _clear(self) -> None:
        """Releases every row and forgets every pass: the cache as made, without a prompt."""
        for seq in self.sequences:
            seq.free()
        self.sequences.clear()
        self._staged = [None] * len(self._staged)
        self._pads = np.zeros((len(self._staged), 0), dtype=np.int64)
        self._pass, self._open_pass, self._pass_start, self._broken = None, None, 0, None
        self._opened_in_pass, self._prompt_pads, self._prompt_end, self._decoding = False, None, 0, False
        self._expand = self._expanded = 1
        self._beam_rows = False


setattr(TieredCache, TIERED_CACHE, True)  # how the hooks recognise a TieredCache
