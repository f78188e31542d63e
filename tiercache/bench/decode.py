"""Long-sequence decode measurements: a synthetic KV workload with needles, a float64
reference computed chunk by chunk, and the three-way timing of a decode step.

``NeedleKV`` generates a sequence's keys and values deterministically, chunk by chunk, from
a seed (so the reference regenerates them instead of reading them back through the code
under test). Background keys are N(0, 1) per channel; a few *needle* blocks hold keys
``b * u_j + N(0, 1)`` along a unit direction ``u_j``; a query aimed at needle ``j`` is
``a * u_j + N(0, noise)``. With ``a = sqrt(D)`` a background score ``q.k / sqrt(D)`` is
about N(0, 1) and a needle score about ``b`` (plus the same noise), so a needle block's
share of the attention mass is close to ``T e^b / (T e^b + N)`` (``T`` tokens per block,
``N`` tokens in all): ``b = log(mass / (1 - mass) * N / T)`` aims at ``mass``. The measured
share on sampled steps is reported beside the target, never assumed.

``step_timings`` times a decode step's attention three ways on the same data: I/O only
(every keyed chunk read and waited for, nothing copied, assembled or computed), compute only
(the same chunks computed from memory, nothing fetched) and pipelined (the real ``attend``);
``overlap_efficiency = max(io_only, compute_only) / pipelined`` (each repeat's, then their
median) is 1.0 when the pipeline
hides the shorter of the two completely; it says little unless the two sides are of similar
size (``balance_verdict``). Every pipelined output is checked against the same attention
computed serially, untimed (``StepCheckError`` otherwise), and an efficiency above
``OVERLAP_LIMIT``, which the pipeline cannot reach by construction, is flagged
(``plausible``). On CUDA every timer read waits for the device first
(``_stopwatch``): kernels are asynchronous, and an unsynchronised clock would time their
launches only.

The page-cache helpers (``pagecache``: ``cached_bytes_of``, ``evict_from_page_cache``) let a benchmark
check, with ``mincore``, that a "cold" read really starts with its files out of memory;
``step_timings`` uses them (``make_cold``) before its I/O-only and pipelined regions, so a
store on a memory filesystem (tmpfs, ``/dev/shm``), whose pages cannot be dropped, is
refused (``ColdReadError``) instead of timing RAM as NVMe.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..attention import _grouped, compute_dtype, merge, partial_attention
from ..live.cache import Sequence, split_kv
from .pagecache import cached_bytes_in, cached_bytes_of, evict_from_page_cache, page_cache_bytes

__all__ = ["NeedleKV", "reference_attention", "step_timings", "rss_peak_bytes", "page_cache_bytes", "cached_bytes_of",
           "cached_bytes_in", "evict_from_page_cache", "median", "BALANCED_RATIO", "is_balanced", "balance_verdict",
           "OVERLAP_LIMIT", "StepCheckError", "ColdReadError", "overlap_problem", "make_cold", "nvme_chunk_paths"]

#: ``io_only / compute_only`` within this range (inclusive): both sides of similar size, so
#: the overlap efficiency says something about overlap.
BALANCED_RATIO = (0.5, 2.0)

#: The highest ``overlap_efficiency`` taken as measured. The pipelined step does the I/O and
#: the compute of the other two regions, so it cannot take less than the longer of them
#: (efficiency <= 1). The 10% above 1 is timing noise only: the three regions of a repeat
#: run back to back, so a change of load slows them alike, and on a 2-core machine under a
#: load of 5 to 7 the medians of 7 of the I/O-only region moved by at most 10% between calls;
#: 14 calls there (``scripts/bench_decode.py``'s layout, 32k tokens) gave efficiencies of
#: 0.51 to 0.89.
OVERLAP_LIMIT = 1.1

#: Largest relative (Frobenius) difference accepted between the pipelined output and the
#: serial one, by compute dtype: the same chunks and merges in the same order, so only
#: rounding may differ.
OUTPUT_RTOL = {torch.float32: 1e-4, torch.float64: 1e-10}


class StepCheckError(RuntimeError):
    """The pipelined step (``Sequence.attend``) returned other attention than the same
    chunks computed serially: its time would not be the time of the work it stands for."""


class ColdReadError(StepCheckError):
    """The files a timed region reads (a step's NVMe chunk files, a benchmark's disk files)
    stayed in the page cache after ``POSIX_FADV_DONTNEED`` (a memory filesystem), or
    residency cannot be checked: the reads timed would not be the cold disk reads they stand
    for (``make_cold``)."""


def median(values) -> float:
    """Median of a non-empty sequence."""
    return float(statistics.median(values))


@dataclass(frozen=True)
class NeedleKV:
    """A deterministic synthetic sequence with needle blocks (see the module docstring).

    Invariants: needle blocks lie strictly between the first and the last block of a prompt
    of three or more blocks (a shorter prompt's needle is block 1: its last block, or none it
    holds, so a sparse read finds it for free; ``scripts/long_context.py`` asks for three);
    ``directions[j]`` is a unit vector.
    """

    tokens: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    needles: int
    seed: int
    mass: float = 0.2
    dtype: torch.dtype = torch.float16

    @property
    def n_blocks(self) -> int:
        return self.tokens // self.block_tokens

    @property
    def needle_blocks(self) -> list[int]:
        """Block indices of the needles (sorted, distinct; see the class invariants)."""
        rng = np.random.default_rng(self.seed)
        inner = max(1, self.n_blocks - 2)
        picks = rng.choice(inner, size=min(self.needles, inner), replace=False) + 1
        return sorted(int(p) for p in picks)

    @property
    def directions(self) -> torch.Tensor:
        """``[needles, D]`` unit directions, one per needle."""
        g = torch.Generator().manual_seed(self.seed + 1)
        d = torch.randn(len(self.needle_blocks), self.head_dim, generator=g, dtype=torch.float64)
        return d / d.norm(dim=1, keepdim=True)

    @property
    def needle_strength(self) -> float:
        """``b``: the needle score aiming at ``mass`` of the attention (see the docstring)."""
        return math.log(self.mass / (1 - self.mass) * self.tokens / self.block_tokens)

    def chunk(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of tokens ``[start, start + count)``, each ``[kv_heads, count, D]``.

        ``start`` and ``count`` must be multiples of ``block_tokens`` and lie within the
        prompt. Any chunking gives the same tokens: the background is drawn in fixed units of
        ``block_tokens * 256`` tokens (the last one cut at the prompt's end), each from a
        generator seeded by its unit, and a chunk copies its part of each unit it overlaps.
        """
        prompt = self.n_blocks * self.block_tokens
        if start % self.block_tokens or count % self.block_tokens:
            raise ValueError("NeedleKV.chunk: start and count must be whole blocks")
        if start < 0 or count < 0 or start + count > prompt:
            raise ValueError(f"NeedleKV.chunk: tokens [{start}, {start + count}) are not within the prompt's {prompt}")
        k = torch.empty((self.kv_heads, count, self.head_dim), dtype=self.dtype)
        v = torch.empty_like(k)
        unit = self.block_tokens * 256
        for index in range(start // unit, -(-(start + count) // unit)):
            first, n = index * unit, min(unit, prompt - index * unit)
            lo, hi = max(start, first), min(start + count, first + n)
            unit_k, unit_v = self._unit(index, n, whole=(lo, hi) == (first, first + n))
            k[:, lo - start : hi - start] = unit_k[:, lo - first : hi - first]
            v[:, lo - start : hi - start] = unit_v[:, lo - first : hi - first]
        self._plant(k, start, count)
        return k, v

    def _unit(self, index: int, tokens: int, whole: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (float32) of background unit ``index`` (``tokens`` long), drawn from its seed.
        A unit a chunk uses only part of is kept (the last one only, so one per ``NeedleKV``)
        for the next chunk, which draws it no more: any chunking costs about the same. Callers
        copy out of it and never write it."""
        kept = self.__dict__.get("_kept_unit")
        if kept is not None and kept[0] == index:
            return kept[1], kept[2]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        k = torch.randn(self.kv_heads, tokens, self.head_dim, generator=g)
        v = torch.randn(self.kv_heads, tokens, self.head_dim, generator=g)
        object.__setattr__(self, "_kept_unit", None if whole else (index, k, v))  # a frozen dataclass's cache
        return k, v

    def _plant(self, k: torch.Tensor, start: int, count: int) -> None:
        strength = self.needle_strength
        directions = self.directions
        for j, block in enumerate(self.needle_blocks):
            a = block * self.block_tokens
            if start <= a < start + count:
                g = torch.Generator().manual_seed(self.seed * 7_919 + block)
                noise = torch.randn(self.kv_heads, self.block_tokens, self.head_dim, generator=g, dtype=torch.float64)
                keys = strength * directions[j] + noise
                k[:, a - start : a - start + self.block_tokens] = keys.to(self.dtype)

    def decode_kv(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the token decode step ``step`` appends (background), ``[kv, 1, D]``."""
        g = torch.Generator().manual_seed(self.seed * 31 + 17 + step)
        k = torch.randn(self.kv_heads, 1, self.head_dim, generator=g).to(self.dtype)
        v = torch.randn(self.kv_heads, 1, self.head_dim, generator=g).to(self.dtype)
        return k, v

    def query(self, step: int, q_heads: int, noise: float = 0.3) -> tuple[torch.Tensor, int]:
        """Step ``step``'s query, ``[q_heads, 1, D]``, and the needle index it aims at.

        Queries aim at needle ``(step // 4) % needles``: four consecutive steps share a
        target (consecutive decode queries are similar), each with its own noise.
        """
        target = (step // 4) % len(self.needle_blocks)
        g = torch.Generator().manual_seed(self.seed * 131 + step)
        scale = math.sqrt(self.head_dim)
        q = scale * self.directions[target] + noise * torch.randn(q_heads, 1, self.head_dim, generator=g, dtype=torch.float64)
        return q.to(self.dtype), target


def reference_attention(kv: NeedleKV, q: torch.Tensor, extra_k: torch.Tensor, extra_v: torch.Tensor,
                        chunk_tokens: int = 1 << 18, needle_block: int | None = None) -> tuple[torch.Tensor, float | None]:
    """Float64 attention of ``q`` over the prompt of ``kv`` plus ``extra`` tokens, computed
    chunk by chunk from regenerated KV (never read back through tiercache).

    Returns:
        ``(out [q_heads, 1, D] float64, share of the attention mass on needle_block)``
        (the share averaged over query heads; None without a block).
    """
    grouped = _grouped(q.double(), kv.kv_heads)
    result = None
    needle = None
    block_tokens = kv.block_tokens
    prompt = kv.n_blocks * block_tokens
    for a in range(0, prompt, chunk_tokens):
        n = min(chunk_tokens, prompt - a)
        k, v = kv.chunk(a, n)
        part = partial_attention(grouped, k.double(), v.double())
        result = part if result is None else merge(result, part)
        if needle_block is not None and a <= needle_block * block_tokens < a + n:
            s = needle_block * block_tokens - a
            needle = partial_attention(grouped, k[:, s : s + block_tokens].double(), v[:, s : s + block_tokens].double())
    if extra_k.shape[1]:
        result = merge(result, partial_attention(grouped, extra_k.double(), extra_v.double()))
    share = None
    if needle is not None:
        share = float(torch.exp(needle.lse - result.lse).mean())
    return result.out.reshape(q.shape), share


def is_balanced(io_compute_ratio: float) -> bool:
    """Whether I/O and compute are within ``BALANCED_RATIO`` of each other."""
    low, high = BALANCED_RATIO
    return low <= io_compute_ratio <= high


def balance_verdict(io_compute_ratio: float) -> str:
    """The words every script prints after ``io/compute``: is the overlap figure meaningful?"""
    return "balanced" if is_balanced(io_compute_ratio) else "NOT within 2x: the figure says little"


def _stopwatch(device: torch.device) -> Callable[[], float]:
    """A clock for timing work on ``device``: ``time.perf_counter``, read after
    ``torch.cuda.synchronize(device)`` on CUDA (kernels run asynchronously: without the wait
    a region would time their launches only, not their work)."""
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def step_timings(seq: Sequence, layer: int, q: torch.Tensor, repeats: int = 3) -> dict:
    """Times one layer's exact attention three ways on the same data (medians, seconds;
    the two ratios are medians of each repeat's own ratio, not ratios of the medians).

    I/O only: every chunk on a keyed tier (NVMe) read into the window with the same
    schedule and waited for (``_wait_for_reads``), nothing copied, assembled, converted or
    computed (chunks in memory tiers need no fetch). Compute only: every chunk, of the same
    sizes, converted into the same scratch buffers and computed from blocks already in
    memory (copies of the first ``depth`` chunks, made before the I/O clock starts), nothing fetched
    (fresh buffers per chunk would page-fault and flatter the overlap). Pipelined: ``seq.attend``,
    whose every output must match ``_serial_output`` (computed once, untimed) within
    ``OUTPUT_RTOL``. Before the I/O-only and the pipelined region (untimed) the NVMe chunk
    files they read are evicted from the page cache and checked with ``mincore``
    (``make_cold``): their reads are cold disk reads, never RAM.

    Every timer read goes through ``_stopwatch(cache.device)``, so on CUDA each region ends
    only when its kernels have finished (and starts after earlier ones have).

    Returns:
        ``io_only_seconds``, ``compute_only_seconds``, ``pipelined_seconds``,
        ``overlap_efficiency``, ``io_compute_ratio``, ``balanced`` (``is_balanced``),
        ``plausible`` (efficiency at most ``OVERLAP_LIMIT``) and ``output_rel_err`` (the
        largest relative difference of a pipelined output from the serial one).

    Raises:
        ValueError: ``repeats`` below 1.
        StepCheckError: a pipelined output differs from the serial one beyond ``OUTPUT_RTOL``.
        ColdReadError: the NVMe chunk files stayed in the page cache (or residency is unknown).
    """
    if repeats < 1:
        raise ValueError(f"step_timings: repeats must be at least 1, got {repeats}")
    cache = seq.cache
    now = _stopwatch(cache.device)
    dtype = compute_dtype(cache.dtype)
    grouped = _grouped(q.to(dtype), cache.layout.kv_heads)
    expected = _serial_output(seq, layer, q)
    io, compute, piped, errors = [], [], [], []
    for _ in range(repeats):
        source = seq.stream_source(layer)
        kept = _first_chunks(source, cache.depth)  # untimed: the compute-only pass's blocks
        paths = nvme_chunk_paths(source)
        make_cold(paths, "I/O only")
        started = now()
        _wait_for_reads(source, cache.depth)
        io.append(now() - started)
        compute.append(_compute_only(source, kept, grouped, now))
        del kept
        make_cold(paths, "pipelined")
        started = now()
        out = seq.attend(layer, q)
        piped.append(now() - started)
        errors.append(_check_output(out, expected, OUTPUT_RTOL[dtype]))
    io_s, compute_s, piped_s = median(io), median(compute), median(piped)
    ratio = median([i / c for i, c in zip(io, compute)])  # each repeat's sides side by side
    efficiency = median([max(i, c) / p for i, c, p in zip(io, compute, piped)])
    return {"io_only_seconds": io_s, "compute_only_seconds": compute_s, "pipelined_seconds": piped_s,
            "overlap_efficiency": efficiency, "io_compute_ratio": ratio, "balanced": is_balanced(ratio),
            "plausible": efficiency <= OVERLAP_LIMIT, "output_rel_err": max(errors)}


def _compute_only(source, kept: list[torch.Tensor], grouped: torch.Tensor, now: Callable[[], float]) -> float:
    """The compute-only region: every chunk of ``source``, of its own size, taken from the
    kept blocks, converted into the pipelined step's own scratch buffers and computed
    (nothing fetched); returns its seconds on ``now``."""
    cache = source.cache
    started = now()
    result = None
    for index in range(source.n_chunks):
        n = len(source.chunks[index][1])
        blocks = kept[index % len(kept)]
        _, k_out, v_out = cache._scratch(index % cache.depth)  # the pipelined step's own buffers
        k, v = split_kv(blocks[: min(n, blocks.shape[0])], k_out, v_out)
        part = partial_attention(grouped, k, v)
        result = part if result is None else merge(result, part)
    return now() - started


def nvme_chunk_paths(source) -> list[str]:
    """The chunk file of every block ``source`` (a ``stream_source``) reads from an NVMe store
    (a keyed medium with files: ``chunk_path``); remote and memory tiers have none."""
    paths = []
    for chunk in source.chunks:
        for piece in chunk.pieces:
            medium = source.cache.store._media[piece.tier]
            if medium.keyed and hasattr(medium, "chunk_path"):
                slots = [medium.slot_of(key) for key in piece.keys]
                paths += [medium.chunk_path(slot) for slot in slots if slot is not None]
    return paths


def make_cold(paths: list[str], region: str, what: str = "NVMe chunk files") -> None:
    """Evicts ``paths`` from the page cache (``evict_from_page_cache``) and checks with
    ``mincore`` that none of their bytes stayed, so that a read that starts now is cold.

    Args:
        paths: the files the region reads.
        region: what reads them, for the message.
        what: what the files are, for the message.

    Raises:
        ColdReadError: bytes stayed cached (a memory filesystem such as tmpfs), or residency
            cannot be checked here (no ``mincore``).
    """
    left = evict_from_page_cache(paths)
    if left is None:
        raise ColdReadError(f"{region}: the page cache cannot be checked here (no mincore), so no read of the {what} "
                            "is known to be cold")
    if left:
        raise ColdReadError(f"{region}: {left} bytes of the {len(paths)} {what} stayed in the page cache after "
                            "POSIX_FADV_DONTNEED (a memory filesystem such as tmpfs?): the reads would come from RAM, "
                            "not the disk; put the files on a disk")


def check_cold_possible(folder: str, probe_bytes: int = 1 << 20) -> None:
    """Raises ``ColdReadError`` at once where files in ``folder`` cannot be read cold (a
    memory filesystem such as tmpfs, or no ``mincore``), before a run writes its own: a probe
    file of ``probe_bytes`` is written there, made cold (``make_cold``) and removed."""
    path = os.path.join(folder, ".tiercache-cold-probe")
    try:
        with open(path, "wb") as probe:
            probe.write(os.urandom(probe_bytes))
        make_cold([path], "a probe written there", "probe file")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def overlap_problem(timing: dict) -> str | None:
    """What a script says (and exits non-zero for) when ``step_timings``' efficiency is
    impossible by construction; None when it is plausible."""
    if timing["plausible"]:
        return None
    return (f"overlap efficiency {timing['overlap_efficiency']:.3f} is above {OVERLAP_LIMIT}: the pipelined step "
            f"({timing['pipelined_seconds']:.4f} s) cannot beat the longer of I/O only ({timing['io_only_seconds']:.4f} s) "
            f"and compute only ({timing['compute_only_seconds']:.4f} s) of the same work; the timing is void")


def _serial_output(seq: Sequence, layer: int, q: torch.Tensor) -> torch.Tensor:
    """``seq.attend(layer, q)``'s exact result computed serially (untimed): each chunk of the
    layer's ``stream_source`` read and converted as the pipeline does (``finish``), computed
    by ``partial_attention`` and merged in chunk order, then the partial tail block."""
    cache = seq.cache
    dtype = compute_dtype(cache.dtype)
    grouped = _grouped(q.to(dtype), cache.layout.kv_heads)
    source = seq.stream_source(layer)
    result = None
    for index in range(source.n_chunks):
        part = partial_attention(grouped, *source.finish(source.start(index, 0)))
        result = part if result is None else merge(result, part)
    state = seq._layers[layer]
    if state.tail_len:
        part = partial_attention(grouped, state.tail[0, :, : state.tail_len], state.tail[1, :, : state.tail_len])
        result = part if result is None else merge(result, part)
    return result.out.reshape(q.shape).to(dtype)


def _check_output(out: torch.Tensor, expected: torch.Tensor, rtol: float) -> float:
    """The relative Frobenius difference of ``out`` from ``expected``; raises
    ``StepCheckError`` above ``rtol`` (or for a wrong shape, or a non-finite output)."""
    if tuple(out.shape) != tuple(expected.shape):
        raise StepCheckError(f"the pipelined step returned shape {tuple(out.shape)}, expected {tuple(expected.shape)}")
    wanted = expected.double()
    error = float((out.double() - wanted).norm() / wanted.norm())
    if not error <= rtol:  # NaN fails too
        raise StepCheckError(f"the pipelined step's output differs from the same attention computed serially "
                             f"(relative error {error:.3g}, at most {rtol:g} accepted): its timing would mean nothing")
    return error


def _first_chunks(source, depth: int) -> list[torch.Tensor]:
    """Copies of the first ``depth`` chunks' blocks as stored (any tier), for the compute-only
    pass; read before the I/O-only clock starts, so that neither the copies nor the assembly
    of a chunk spread over several tiers are timed as I/O."""
    kept = []
    for index in range(min(depth, source.n_chunks)):
        kept.append(source.raw(source.start(index, index)).clone())
    return kept


def _wait_for_reads(source, depth: int) -> None:
    """The I/O-only region: starts every chunk's keyed-tier reads with ``stream_attention``'s
    window schedule (``depth`` chunks in flight) and waits for each keyed piece to land on the
    compute device, in chunk order. Nothing else: a piece held in a memory tier needs no
    fetch, and no chunk is assembled or copied (``TierChunks._piece_blocks`` of a keyed piece
    is the read's wait, its check, and on a GPU the copy to the device the pipeline makes too)."""
    pending = [source.start(i, i % depth) for i in range(min(depth, source.n_chunks))]
    for index in range(source.n_chunks):
        handle = pending.pop(0)
        for number, _, _ in handle[2][1] if handle[2] is not None else ():
            source._piece_blocks(handle, number)
        if index + depth < source.n_chunks:
            pending.append(source.start(index + depth, (index + depth) % depth))


def rss_peak_bytes() -> int:
    """Peak resident set of this process (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_count() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
