"""Sweeps: load a trace once, replay it for every policy × capacity × semantics.

``run_sweep`` returns the results document (``results.json``) shared by ``tiercache replay``,
``tiercache compare`` and ``tiercache report``.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

import tiercache
from tiercache.config import KVLayout, TierConfig, layout_preset, parse_layout, parse_tiers
from tiercache.errors import UserError
from tiercache.policies import get_admission, get_eviction

from .replay import ReplayData, RunSpec, Semantics, replay
from .traces import iter_json_objects, load_flat, next_use, trace_fingerprint

__all__ = ["load_replay_data", "plan_runs", "run_sweep", "MOONCAKE_BLOCK_TOKENS"]

#: Tokens per ``hash_ids`` entry in Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class SweepSpec:
    """Everything a sweep needs besides the trace itself."""

    policies: tuple[str, ...]
    capacities: tuple[int, ...]
    semantics: tuple[str, ...]
    tiers: tuple[TierConfig, ...] | None = None
    admission: str = "always"
    write_through: bool = False


def trace_kind(path: str) -> str:
    """``request`` (Mooncake JSONL) or ``step`` (decode step trace), from the first record."""
    for _, obj in iter_json_objects(path):
        return "step" if "step" in obj else "request"
    return "request"  # empty: the request reader reports it with the file name


def load_replay_data(path: str, layout: KVLayout | None, profile: object | None) -> tuple[ReplayData, dict]:
    """Reads a trace once; returns the replay arrays and the trace summary for results.json."""
    if trace_kind(path) == "step":
        from .steptrace import load_flat_steps

        flat = load_flat_steps(path)
        ids, offsets, lengths, is_write = flat.ids, flat.offsets, None, flat.is_write
        block_tokens = layout.block_tokens if layout else 1
    else:
        flat = load_flat(path)
        ids, offsets, lengths, is_write = flat.ids, flat.offsets, flat.input_lengths, None
        block_tokens = MOONCAKE_BLOCK_TOKENS
    summary = {
        "path": os.path.abspath(path),
        "name": os.path.basename(path),
        "fingerprint": trace_fingerprint(path),
        "kind": "step" if is_write is not None else "request",
        "requests": int(len(offsets)),
        "accesses": int(len(ids)),
        "unique_blocks": int(len(np.unique(ids))),
    }
    data = ReplayData(ids.tolist(), offsets, next_use(ids).tolist(), lengths, is_write, layout, profile, block_tokens)
    return data, summary


def plan_runs(spec: SweepSpec) -> list[RunSpec]:
    """Every run of the sweep, validated (unknown policies fail before anything runs).

    Raises:
        UserError: an unknown eviction or admission policy, or semantics name.
    """
    for name in spec.policies:
        get_eviction(name)
    get_admission(spec.admission)
    semantics = [Semantics.parse(text) for text in spec.semantics]
    if spec.tiers is not None:
        return [RunSpec(p, s, spec.tiers, spec.admission, spec.write_through) for s in semantics for p in spec.policies]
    return [
        RunSpec(p, s, (TierConfig("hbm", c),), spec.admission)
        for s in semantics
        for c in spec.capacities
        for p in spec.policies
    ]


_WORKER_DATA: ReplayData | None = None  # set in the parent before forking workers


def _run_in_worker(spec: RunSpec) -> dict:
    return replay(spec, _WORKER_DATA)


def _execute(runs: list[RunSpec], data: ReplayData, workers: int, progress: bool) -> list[dict]:
    """Runs every replay, in worker processes when asked, with a progress bar over runs."""
    global _WORKER_DATA
    if len(runs) == 1:  # one long replay: show progress over its requests instead
        with tqdm(total=data.n_batches, desc="replay", unit="req", disable=not progress, delay=2) as bar:
            return [replay(runs[0], data, on_progress=bar.update)]
    bar = tqdm(total=len(runs), desc="replays", unit="run", disable=not progress, delay=2)
    try:
        if workers <= 1:
            return [_with_bar(bar, replay(spec, data)) for spec in runs]
        _WORKER_DATA = data
        context = multiprocessing.get_context("fork")
        with context.Pool(min(workers, len(runs))) as pool:
            return [_with_bar(bar, r) for r in pool.imap(_run_in_worker, runs)]
    finally:
        _WORKER_DATA = None
        bar.close()


def _with_bar(bar: tqdm, record: dict) -> dict:
    bar.update(1)
    return record


def run_sweep(
    trace_path: str,
    policies: list[str],
    capacities: list[int],
    semantics: list[str],
    tiers: str | None = None,
    model: str | None = None,
    layout: str | None = None,
    hardware: str | None = None,
    workers: int = 1,
    progress: bool = True,
    admission: str = "always",
    write_through: bool = False,
    command: str | None = None,
) -> dict:
    """Replays a trace for every policy × capacity × semantics; returns results.json's document.

    With ``tiers`` (``"hbm=4096,dram=16GiB"``), each policy runs once per semantics on that
    hierarchy and ``capacities`` is ignored. ``model`` names a layout preset (blocks of 512
    tokens, the Mooncake block size) so that runs report bytes; ``layout`` is a custom one
    instead (``"layers=32,kv_heads=8,head_dim=128,dtype=bfloat16"``, see ``parse_layout``;
    exclusive with ``model``); ``hardware`` a preset or profile file for modeled seconds.

    Raises:
        UserError: a bad option, policy or trace (the message names it).
    """
    kv_layout = _resolve_layout(model, layout, trace_path)
    profile = _load_profile(hardware) if hardware else None
    tier_configs = parse_tiers(tiers, kv_layout) if tiers else None
    spec = SweepSpec(tuple(policies), tuple(capacities), tuple(semantics), tier_configs, admission, write_through)
    runs = plan_runs(spec)
    data, summary = load_replay_data(trace_path, kv_layout, profile)
    records = _execute(runs, data, workers, progress)
    return {
        "tiercache_version": tiercache.__version__,
        "command": command or "",
        "trace": summary,
        "layout": _layout_dict(kv_layout),
        "hardware": getattr(profile, "name", None),
        "runs": records,
    }


def _resolve_layout(model: str | None, layout: str | None, trace_path: str) -> KVLayout | None:
    """The KV layout of ``--model`` or ``--layout`` (exclusive), or None.

    A preset always gets blocks of 512 tokens. A custom layout does too on a request trace
    (a Mooncake ``hash_ids`` entry is 512 tokens); on a step trace it keeps its own
    ``block_tokens`` (256 unless the spec says otherwise).

    Raises:
        UserError: both given, or the spec is invalid.
    """
    if model and layout:
        raise UserError("--model and --layout are exclusive; give one")
    if model:
        return layout_preset(model, MOONCAKE_BLOCK_TOKENS)
    if layout:
        block_tokens = MOONCAKE_BLOCK_TOKENS if trace_kind(trace_path) == "request" else None
        return parse_layout(layout, block_tokens)
    return None


def _load_profile(hardware: str) -> object:
    from .hardware import load_profile

    return load_profile(hardware)


def _layout_dict(layout: KVLayout | None) -> dict | None:
    if layout is None:
        return None
    return {
        "name": layout.name,
        "layers": layout.layers,
        "kv_heads": layout.kv_heads,
        "head_dim": layout.head_dim,
        "dtype": layout.dtype,
        "block_tokens": layout.block_tokens,
        "block_bytes": layout.block_bytes,
    }
