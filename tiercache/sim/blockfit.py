"""Whether a request trace's ``hash_ids`` fit its prompts: one id per ``block_tokens`` tokens.

A request of ``input_length`` tokens in blocks of ``block_tokens`` lists
``ceil(input_length / block_tokens)`` ids. The Mooncake form has no block-size field (512
is assumed; Bailian's 16, a kv-cache-tester workload its ``block_size``), so a trace hashed
with other blocks (vLLM's 16 tokens, LMCache's 256) loads, and every reused block would count
512 tokens. ``block_fit`` counts the requests whose ids do not fit, and the block size their
lengths imply (a power of two more than ``IMPLIED_SHARE`` of them fit); ``trace inspect`` shows
it and ``replay`` warns past ``WARN_SHARE``. A few
off-by-one records are normal in real traces: a trace is never refused for this.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["BlockFit", "block_fit", "WARN_SHARE", "IMPLIED_SHARE"]

#: ``replay`` warns when more than this share of a trace's requests do not fit.
WARN_SHARE = 0.01
#: A block size is named as implied only when more than this share of the mismatched requests
#: fit it: a majority, so a few stray requests never name one for the whole trace.
IMPLIED_SHARE = 0.5
#: Block sizes tried for the one the mismatched requests imply: powers of two, 1 to 2**20 tokens.
_CANDIDATES = tuple(1 << k for k in range(21))


@dataclass(frozen=True)
class BlockFit:
    """How a request trace's ``hash_ids`` counts fit its ``input_length`` values.

    Invariants: ``0 <= mismatched <= requests``; ``first`` is the arrival index of the first
    request that does not fit (None when all do); ``implied_block_tokens`` is the power of
    two that more than ``IMPLIED_SHARE`` of the mismatched requests fit, else None.
    """

    requests: int
    mismatched: int
    first: int | None
    block_tokens: int
    implied_block_tokens: int | None

    @property
    def share(self) -> float:
        """Mismatched requests over all requests."""
        return self.mismatched / self.requests if self.requests else 0.0

    def summary(self) -> str:
        """``3 of 120 (2.50%); their lengths imply 128-token blocks``."""
        text = f"{self.mismatched:,} of {self.requests:,} ({100 * self.share:.2f}%)"
        if self.implied_block_tokens is not None and self.implied_block_tokens != self.block_tokens:
            text += f"; their lengths imply {self.implied_block_tokens}-token blocks"
        return text


def block_fit(ids_per_request: np.ndarray, input_lengths: np.ndarray, block_tokens: int) -> BlockFit:
    """Counts the requests whose id count is not ``ceil(input_length / block_tokens)``.

    Args:
        ids_per_request: ``len(hash_ids)`` of each request, in arrival order.
        input_lengths: each request's ``input_length``, same order.
        block_tokens: the trace's tokens per block (> 0).
    """
    counts = np.asarray(ids_per_request, dtype=np.int64)
    lengths = np.asarray(input_lengths, dtype=np.int64)
    wrong = counts != -(-lengths // block_tokens)
    mismatched = int(wrong.sum())
    first = int(np.argmax(wrong)) if mismatched else None
    return BlockFit(len(counts), mismatched, first, block_tokens, _implied(counts[wrong], lengths[wrong]))


def _implied(counts: np.ndarray, lengths: np.ndarray) -> int | None:
    """The power of two that more than ``IMPLIED_SHARE`` of these (mismatched) requests fit,
    or None. A request of no tokens or no ids fits no size but counts among them."""
    total = len(counts)
    keep = (counts > 0) & (lengths > 0)
    counts, lengths = counts[keep], lengths[keep]
    if not len(counts):
        return None
    fits = [int((counts == -(-lengths // size)).sum()) for size in _CANDIDATES]
    best = int(np.argmax(fits))
    return _CANDIDATES[best] if fits[best] > IMPLIED_SHARE * total else None
