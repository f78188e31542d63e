"""What a prefix hit reuses: the blocks a request's lookup may reuse and the prompt tokens its
hit saves (``tiercache replay``'s and the fleet replay's prefix semantics)."""

from __future__ import annotations

import numpy as np

__all__ = ["reusable_blocks", "reusable_caps", "saved_prompt_tokens"]


def reusable_blocks(block_tokens: int, input_length: int) -> int:
    """Leading blocks of a request that a prefix lookup may reuse: those holding any of its
    first ``input_length - 1`` tokens. A serving engine matches at most that many tokens (the
    last one is computed to produce the first output token: vLLM's and SGLang's lookups stop
    at ``n - 1`` tokens), so a block holding only the last prompt token, or none (a request
    whose trace lists more blocks than its tokens fill), is recomputed and stored like a
    miss, never loaded, whatever the cache holds."""
    return -(-max(input_length - 1, 0) // block_tokens)


def saved_prompt_tokens(hit_blocks: int, block_tokens: int, input_length: int) -> int:
    """Prompt tokens a request reuses from its ``hit_blocks`` cached prefix blocks: their tokens,
    at most ``input_length - 1`` (0 for an empty prompt). A serving engine computes at least the
    last prompt token to produce the first output token, so even a request found entirely in
    the cache has one token of prefill (vLLM and SGLang recompute the last token on a full hit)."""
    return min(hit_blocks * block_tokens, max(input_length - 1, 0))


def reusable_caps(input_lengths: np.ndarray, offsets: np.ndarray, block_tokens: int, prefix: bool) -> np.ndarray:
    """Each request's ``reusable_blocks`` in prefix semantics; every block of it otherwise
    (object semantics has no cap): int64, one per request (``offsets`` has one more entry),
    at least one entry (the compiled replay's argument)."""
    if prefix:
        caps = -(-np.maximum(input_lengths.astype(np.int64) - 1, 0) // block_tokens)
    else:
        caps = np.diff(offsets).astype(np.int64)
    return caps if len(caps) else np.zeros(1, dtype=np.int64)
