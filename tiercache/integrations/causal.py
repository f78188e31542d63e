"""The part of a forward pass's attention that no tier holds yet: each new query over the new
keys at or before it (causal), with left-padding columns left out, and the attention mask a
``TieredCache`` expects ``transformers`` to pass for such a pass.

Both work in ``Sequence.attend_partial``'s grouped layout, so the result merges by log-sum-exp
with attention over the tokens a sequence already holds.
"""

from __future__ import annotations

import math

import torch

from tiercache.attention import SCORE_BUDGET, Partial, may_overflow, partial_attention

__all__ = ["causal_partial", "expected_mask"]

# The largest |log-sum-exp| the fused path hands on: float32's step there (3e-5) keeps the
# merge weights within float32 attention's error; real models' scaled scores stay far below.
_FUSED_LSE_LIMIT = 256.0


def causal_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype,
                   key_pos: torch.Tensor | None = None) -> Partial:
    """Causal attention of ``t`` queries (``q``: ``[heads, t, D]``) over the pass's kept keys.

    Args:
        k, v: ``[kv_heads, n, D]``: the kept keys, ``n <= t``.
        key_pos: the pass positions (``0 .. t-1``, increasing) of the ``n`` kept keys; None:
            every position is kept (``n == t``). Query ``i`` sees kept keys at positions
            ``<= i``; a query that sees none (a padding query) gets a zero output and an
            empty partial (``peak`` -inf, ``total`` 0).
        dtype: the compute dtype; a score that overflows it reruns the chunk in float64.

    Queries are taken a slice at a time so that no call scores more than ``SCORE_BUDGET``
    pairs.

    Returns:
        The partial in the grouped layout: ``out`` ``[kv_heads, group * t, D]`` (row
        ``g * t + i``), ``peak``/``total`` ``[kv_heads, group * t]``.
    """
    heads, tokens, head_dim = q.shape
    kv_heads = k.shape[0]
    if key_pos is None:
        fused = _fused_causal(q, k, v, dtype)
        if fused is not None:
            return fused
        key_pos = torch.arange(tokens, device=k.device)
    grouped = q.reshape(kv_heads, heads // kv_heads, tokens, head_dim)
    step = max(1, SCORE_BUDGET // (heads * max(1, k.shape[1])))  # queries per call: bounded scores
    parts = [_causal_chunk(grouped, k, v, key_pos, start, min(start + step, tokens), dtype)
             for start in range(0, tokens, step)]
    out = torch.cat([p.out for p in parts], dim=2)
    peak = torch.cat([p.peak for p in parts], dim=2)
    total = torch.cat([p.total for p in parts], dim=2)
    flat = (kv_heads, -1)
    return Partial(out.reshape(*flat, head_dim), peak.reshape(flat), total.reshape(flat))


def _fused_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> Partial | None:
    """``causal_partial`` without padding through torch's fused CPU flash attention, which
    returns the log-sum-exp a merge needs (16x faster than the sliced path at 1k tokens on
    this CPU); None where it does not apply: another device, a torch without the operator,
    or a log-sum-exp beyond ``_FUSED_LSE_LIMIT``. The operator gives the log-sum-exp alone,
    not the peak and the sum apart (``Partial``): next to a large peak, float32 rounds the
    log of the sum away, and keys tied with the held ones would lose their count in the
    merge; the sliced path keeps them apart (and reruns an overflow in float64)."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or q.device.type != "cpu":
        return None
    heads, tokens, head_dim = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    keys = k.to(dtype).repeat_interleave(group, dim=0)  # query head h reads KV head h // group
    values = v.to(dtype).repeat_interleave(group, dim=0)
    try:
        out, lse = op(q.to(dtype).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), 0.0, True)
    except (RuntimeError, TypeError):  # an operator of another signature: the sliced path
        return None
    if not bool((lse.abs() <= _FUSED_LSE_LIMIT).all() & torch.isfinite(out).all()):  # one check: overflow
        return None  # (inf/NaN scores or output) or a large score
    return Partial(out[0].reshape(kv_heads, group * tokens, head_dim), lse[0].reshape(kv_heads, group * tokens))


def _causal_chunk(grouped: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_pos: torch.Tensor, start: int,
                  stop: int, dtype: torch.dtype) -> Partial:
    """Queries ``start:stop`` of ``grouped`` (``[kv_heads, group, t, D]``) over the kept keys
    before ``stop``; the partial's tensors keep the ``[kv_heads, group, stop - start, ...]`` shape."""
    kv_heads, group, _, head_dim = grouped.shape
    rows = stop - start
    shape = (kv_heads, group, rows)
    seen = int(torch.searchsorted(key_pos, torch.tensor(stop, device=key_pos.device)))  # kept keys before stop
    if seen == 0:  # only padding queries: nothing to see
        empty = torch.zeros(*shape, dtype=dtype, device=grouped.device)
        return Partial(empty.unsqueeze(-1).expand(*shape, head_dim).clone(), empty - math.inf, empty)
    queries = torch.arange(start, stop, device=k.device)
    allowed = key_pos[:seen].unsqueeze(0) <= queries.unsqueeze(1)  # [rows, seen]
    sees = allowed.any(dim=1).repeat(group)  # [group * rows]: queries that see a key
    allowed = allowed.repeat(group, 1) | ~sees.unsqueeze(1)  # a padding query computes a throwaway row
    wide = may_overflow(grouped, k, v)
    for kind in (dtype, torch.float64):
        q = grouped[:, :, start:stop].reshape(kv_heads, group * rows, head_dim).to(kind)
        part = partial_attention(q, k[:, :seen], v[:, :seen], allowed=allowed)
        # fp16 inputs cannot overflow float32: check (one host sync) only wider inputs, scores and
        # output both (V near the dtype's max overflows the weighted sum)
        if kind == torch.float64 or not wide or bool(torch.isfinite(part.peak[:, sees]).all()
                                                     & torch.isfinite(part.out[:, sees]).all()):
            break
    out = torch.where(sees.unsqueeze(-1), part.out, 0.0)
    peak = torch.where(sees, part.peak, -math.inf)
    total = torch.where(sees, part.total, 0.0)
    return Partial(out.reshape(*shape, head_dim), peak.reshape(shape), total.reshape(shape))


def expected_mask(pads: list[int], keep: torch.Tensor | None, held: int, tokens: int,
                  device: torch.device) -> torch.Tensor:
    """The boolean mask (``[batch, t, held + t]``, True: may attend) ``transformers`` builds
    for a pass of ``t`` new tokens after ``held`` positions, where row ``b``'s first
    ``pads[b]`` positions are left padding and ``keep`` (``[batch, t]``, None: all) marks the
    pass's columns that are not padding: every query sees the held positions after the padding
    and the kept new ones at or before it."""
    batch = len(pads)
    columns = torch.arange(held + tokens, device=device)
    queries = torch.arange(tokens, device=device)
    prior = columns.unsqueeze(0) >= torch.tensor(pads, device=device).unsqueeze(1)  # [batch, held + t]
    prior = prior & (columns < held)
    causal = (columns.unsqueeze(0) - held <= queries.unsqueeze(1)) & (columns >= held)  # [t, held + t]
    new = causal.unsqueeze(0).expand(batch, tokens, held + tokens)
    if keep is not None:
        kept = torch.zeros(batch, held + tokens, dtype=torch.bool, device=device)
        kept[:, held:] = keep
        new = new & kept.unsqueeze(1)
    return prior.unsqueeze(1) | new
