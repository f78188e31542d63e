"""Seeded synthetic traces: full-attention scan, sparse top-k with locality, document QA.

Every generator is a pure function of its spec: the same spec (seed included) gives the same
trace on every run and platform (numpy's ``Generator`` with PCG64 is stable across
platforms for the draws used here). Specs are frozen, validated dataclasses.

Block ids of the step generators: block ``b`` (0-based position in the sequence) at layer
``l`` of ``layers`` has id ``b * layers + l``, so per-layer copies are distinct objects and
``layers == 1`` gives ``id == b``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Iterator

import numpy as np

from tiercache.errors import UserError
from tiercache.sim.steptrace import MAX_BLOCK_TOKENS, StepRecord
from tiercache.sim.traces import MOONCAKE_BLOCK_TOKENS, Request

__all__ = ["ScanSpec", "SparseSpec", "DocsSpec", "SpecError", "scan_trace", "sparse_trace", "docs_trace"]

class SpecError(UserError):
    """A spec field out of range. ``field`` names it and ``reason`` says why, so a caller
    (the CLI) can name its own option for the field instead of ``Spec.field``."""

    def __init__(self, spec: str, field: str, reason: str) -> None:
        super().__init__(f"{spec}.{field}: {reason}")
        self.field = field
        self.reason = reason


def _check(spec: object, bounds: dict[str, tuple[float, float | None]]) -> None:
    """Raises SpecError naming the first field of the wrong type or outside ``[low, high]``
    (``high`` None: no upper bound). Numbers must be finite: NaN and infinities fail."""
    for f in fields(spec):
        if f.name not in bounds:
            continue
        value = getattr(spec, f.name)
        low, high = bounds[f.name]
        kind = (int,) if f.type == "int" else (int, float)  # annotations are strings here
        ok = not isinstance(value, bool) and isinstance(value, kind) and math.isfinite(value)
        if not ok or value < low or (high is not None and value > high):
            what = "an integer" if f.type == "int" else "a number"
            limit = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise SpecError(type(spec).__name__, f.name, f"must be {what} {limit}, got {value!r}")


@dataclass(frozen=True)
class ScanSpec:
    """A sequence decoded with full attention.

    Step 0 prefills ``prompt_blocks`` blocks (writes them; no record when 0). Decode step
    ``t`` (1..steps) appends token ``t``: it reads every *full* block so far and, when the
    token fills a block (``t % block_tokens == 0``), writes that block. The partial tail
    block stays in the working buffer and is never a stored block.
    """

    steps: int
    prompt_blocks: int = 0
    block_tokens: int = 16
    layers: int = 1

    def __post_init__(self) -> None:
        _check(self, {"steps": (1, None), "prompt_blocks": (0, None), "block_tokens": (1, MAX_BLOCK_TOKENS),
                      "layers": (1, None)})

    @property
    def most_blocks(self) -> int:
        """Full blocks the sequence holds at its last step."""
        return _full_blocks(self.prompt_blocks, self.block_tokens, self.steps)


@dataclass(frozen=True)
class SparseSpec:
    """A sequence decoded with sparse top-k attention (Quest/InfLLM-like access pattern).

    Each decode step reads, per layer: the first ``sink`` blocks, the last ``window`` full
    blocks, and ``k`` blocks of the middle. Of the previous step's middle choices each is
    kept with probability ``locality`` (temporal locality: top-k sets drift slowly); the
    rest of the ``k`` are drawn uniformly from the middle blocks *not* chosen at the previous
    step, so a chosen block stays chosen next step with probability exactly ``locality``
    whenever the middle holds at least ``2 * k`` blocks. In a smaller middle the unchosen
    blocks may run short: then all of them are read and the remainder is drawn from the
    dropped choices (a stay probability above ``locality``). When the middle holds at most ``k``
    blocks all are read. Prefill and writes are as in ``ScanSpec``. ``k + sink + window`` is at
    least 1 (else no step reads a block, and trace readers refuse a trace without a read).
    """

    steps: int
    prompt_blocks: int = 64
    k: int = 8
    sink: int = 1
    window: int = 4
    locality: float = 0.9
    block_tokens: int = 16
    layers: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        counts = {"steps": (1, None), "prompt_blocks": (0, None), "k": (0, None), "sink": (0, None), "window": (0, None)}
        _check(self, {**counts, "locality": (0.0, 1.0), "block_tokens": (1, MAX_BLOCK_TOKENS), "layers": (1, None),
                      "seed": (0, None)})
        if self.k + self.sink + self.window == 0:  # readers refuse a step trace without a read
            raise SpecError(type(self).__name__, "k", "k, sink and window are all 0: no step reads a block; "
                            "give one of them >= 1")

    @property
    def most_blocks(self) -> int:
        """Full blocks the sequence holds at its last step."""
        return _full_blocks(self.prompt_blocks, self.block_tokens, self.steps)

    @property
    def is_sparse(self) -> bool:
        """False when sinks, window and k cover every block at the last step (a full scan)."""
        return self.k + self.sink + self.window < self.most_blocks


@dataclass(frozen=True)
class DocsSpec:
    """Many documents queried repeatedly, as a Mooncake-format request trace.

    Each request is ``system_blocks`` shared system-prompt blocks, then the blocks of one
    document chosen by a Zipf law over ranks (``P(d) ~ 1 / (d + 1) ** zipf``; 0 is
    uniform), then ``question_blocks`` blocks unique to the request. Ids form a prefix
    tree: system ids ``0..S-1``, document ``d`` owns ``S + d*L .. S + (d+1)*L - 1``, and
    question ids count up from ``S + docs*L``. Arrivals are Poisson at ``rate_per_s``.
    """

    docs: int
    doc_blocks: int
    requests: int
    system_blocks: int = 2
    question_blocks: int = 1
    zipf: float = 1.0
    rate_per_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        counts = {"docs": (1, None), "doc_blocks": (1, None), "requests": (1, None), "system_blocks": (0, None),
                  "question_blocks": (0, None)}
        _check(self, {**counts, "zipf": (0.0, None), "rate_per_s": (1e-9, None), "seed": (0, None)})


# ----------------------------------------------------------------------------- step traces


def _layer_ids(blocks: np.ndarray | range, layers: int, layer: int) -> tuple[int, ...]:
    return tuple((np.asarray(blocks, dtype=np.int64) * layers + layer).tolist())


def _prefill(prompt_blocks: int, layers: int) -> Iterator[StepRecord]:
    if prompt_blocks:
        for layer in range(layers):
            yield StepRecord(0, layer, (), _layer_ids(range(prompt_blocks), layers, layer))


def _full_blocks(prompt_blocks: int, block_tokens: int, step: int) -> int:
    """Full blocks before decode step ``step`` (1-based) appends its token."""
    return prompt_blocks + (step - 1) // block_tokens


def _written(prompt_blocks: int, block_tokens: int, step: int, layers: int, layer: int) -> tuple[int, ...]:
    """The block that decode step ``step`` fills, if any."""
    if step % block_tokens:
        return ()
    return _layer_ids([_full_blocks(prompt_blocks, block_tokens, step)], layers, layer)


def scan_trace(spec: ScanSpec) -> Iterator[StepRecord]:
    """Step records of a full-attention decode (see ``ScanSpec``)."""
    yield from _prefill(spec.prompt_blocks, spec.layers)
    for step in range(1, spec.steps + 1):
        full = _full_blocks(spec.prompt_blocks, spec.block_tokens, step)
        for layer in range(spec.layers):
            read = _layer_ids(range(full), spec.layers, layer)
            yield StepRecord(step, layer, read, _written(spec.prompt_blocks, spec.block_tokens, step, spec.layers, layer))


def _choose_middle(rng: np.random.Generator, previous: np.ndarray, lo: int, hi: int, spec: SparseSpec) -> np.ndarray:
    """Top-k stand-in: ``k`` distinct sorted blocks of ``[lo, hi)`` (all of them if at most ``k``).

    Keeps each previous middle choice with probability ``locality`` and refills uniformly
    from the blocks of ``[lo, hi)`` not in ``previous``; only when those run short does the
    refill take (uniformly) from the dropped previous choices, so a dropped block is never
    chosen again at once while another block could be.
    """
    if hi - lo <= spec.k:
        return np.arange(lo, hi, dtype=np.int64)
    in_range = previous[(previous >= lo) & (previous < hi)]
    kept = in_range[rng.random(len(in_range)) < spec.locality][: spec.k]
    need = spec.k - len(kept)
    unchosen = np.setdiff1d(np.arange(lo, hi, dtype=np.int64), in_range, assume_unique=True)
    if len(unchosen) >= need:
        fresh = rng.choice(unchosen, size=need, replace=False)
    else:  # a middle of fewer than 2k blocks: every unchosen block, the rest from the dropped
        dropped = np.setdiff1d(in_range, kept, assume_unique=True)
        fresh = np.concatenate([unchosen, rng.choice(dropped, size=need - len(unchosen), replace=False)])
    return np.sort(np.concatenate([kept, fresh]))


def _sparse_blocks(rng: np.random.Generator, previous: np.ndarray, full: int, spec: SparseSpec) -> tuple[np.ndarray, np.ndarray]:
    """(blocks read, new middle choice) for one layer of one step; read blocks sorted, distinct."""
    sink_end = min(spec.sink, full)
    window_start = max(sink_end, full - spec.window)
    middle = _choose_middle(rng, previous, sink_end, window_start, spec)
    read = np.concatenate([np.arange(sink_end), middle, np.arange(window_start, full)])
    return read, middle


def sparse_trace(spec: SparseSpec) -> Iterator[StepRecord]:
    """Step records of a sparse top-k decode with temporal locality (see ``SparseSpec``)."""
    rng = np.random.default_rng(spec.seed)
    chosen = [np.zeros(0, dtype=np.int64) for _ in range(spec.layers)]  # each layer has its own top-k
    yield from _prefill(spec.prompt_blocks, spec.layers)
    for step in range(1, spec.steps + 1):
        full = _full_blocks(spec.prompt_blocks, spec.block_tokens, step)
        for layer in range(spec.layers):
            read, chosen[layer] = _sparse_blocks(rng, chosen[layer], full, spec)
            written = _written(spec.prompt_blocks, spec.block_tokens, step, spec.layers, layer)
            yield StepRecord(step, layer, _layer_ids(read, spec.layers, layer), written)


# ----------------------------------------------------------------------------- request traces


def _zipf_probabilities(n: int, exponent: float) -> np.ndarray:
    """``P(rank r) ~ 1 / r ** exponent`` for ranks ``1..n``, summing to 1.

    Any finite ``exponent >= 0`` works without a floating-point warning: a power past the
    float64 range (``r ** exponent`` > ~1.8e308) gives weight 0 instead of one below 1e-308,
    which beside rank 1's weight of 1 moves no probability by as much as 1e-308 (such ranks
    are never drawn either way). Every other weight is the plain ``1 / r ** exponent``, the
    values the trace was always drawn with.
    """
    with np.errstate(over="ignore"):  # r ** exponent -> inf, and 1 / inf == 0.0 exactly
        weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** exponent
    return weights / weights.sum()


def docs_trace(spec: DocsSpec) -> Iterator[Request]:
    """Requests of a many-documents QA workload (see ``DocsSpec``), in arrival order.

    ``input_length`` is consistent with the blocks: ``len(hash_ids) == ceil(input_length / 512)``.

    Raises:
        SpecError: the drawn arrivals run past 2**63 ms (``rate_per_s`` too low for ``requests``),
            on the first ``next``.
    """
    rng = np.random.default_rng(spec.seed)
    n = spec.requests
    # All draws up front, in a fixed order, so the trace does not depend on iteration.
    doc = rng.choice(spec.docs, size=n, p=_zipf_probabilities(spec.docs, spec.zipf))
    arrivals = np.rint(np.cumsum(rng.exponential(1000.0 / spec.rate_per_s, size=n)))
    if arrivals[-1] >= 2.0**63:  # the int64 millisecond timestamps of the trace format
        raise SpecError("DocsSpec", "rate_per_s", f"{n:,} requests at {spec.rate_per_s:g} per second arrive past 2**63 ms; "
                        "give a higher rate or fewer requests")
    times = arrivals.astype(np.int64)
    tails = rng.integers(1, MOONCAKE_BLOCK_TOKENS + 1, size=n)
    outputs = rng.integers(1, 1024, size=n)
    system = list(range(spec.system_blocks))
    next_question = spec.system_blocks + spec.docs * spec.doc_blocks
    blocks = spec.system_blocks + spec.doc_blocks + spec.question_blocks
    for i in range(n):
        start = spec.system_blocks + int(doc[i]) * spec.doc_blocks
        questions = list(range(next_question, next_question + spec.question_blocks))
        next_question += spec.question_blocks
        ids = tuple(system + list(range(start, start + spec.doc_blocks)) + questions)
        length = (blocks - 1) * MOONCAKE_BLOCK_TOKENS + int(tails[i])
        yield Request(int(times[i]), length, int(outputs[i]), ids, 0)
