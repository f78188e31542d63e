"""Results documents (``results.json``) read, checked and merged into one report's data.

A results document is what ``tiercache replay --out`` and ``run_sweep`` write: the trace's
identity and statistics, the layout and hardware presets, and one entry per replay run.
Several documents merge into one report only when they describe the same trace (same
``trace.fingerprint``) under the same layout and hardware, so every figure compares like
with like.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError

__all__ = ["TraceInfo", "TierResult", "Run", "ReportData", "load_results", "from_documents", "run_label"]

_REQUIRED_RUN_KEYS = ("policy", "semantics", "capacity_blocks", "accesses", "hits", "misses", "miss_ratio")


@dataclass(frozen=True)
class TraceInfo:
    """Identity and size of the replayed trace."""

    path: str
    name: str
    fingerprint: str
    requests: int
    accesses: int
    unique_blocks: int

    @property
    def compulsory_miss_ratio(self) -> float:
        """Misses no cache avoids (first accesses) over accesses, in object semantics."""
        return self.unique_blocks / self.accesses if self.accesses else 1.0


@dataclass(frozen=True)
class TierResult:
    """One tier of one run."""

    name: str
    capacity_blocks: int
    hits: int
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0


@dataclass(frozen=True)
class Run:
    """One replay: a policy at a capacity under one semantics and hierarchy mode.

    ``bytes_moved``/``modeled_seconds`` are empty when no layout was known; the prefill
    fields are None outside prefix semantics (``ttft_saved_s`` also without hardware).
    """

    policy: str
    admission: str
    semantics: str
    mode: str
    capacity_blocks: int
    accesses: int
    hits: int
    misses: int
    miss_ratio: float
    hit_ratio: float
    tiers: tuple[TierResult, ...] = ()
    bytes_moved: dict[str, int] = field(default_factory=dict)
    modeled_seconds: dict[str, float] = field(default_factory=dict)
    prefill_tokens: int | None = None
    prefill_tokens_saved: int | None = None
    ttft_saved_s: float | None = None
    wall_seconds: float | None = None

    @property
    def label(self) -> str:
        """The policy as named on the command line (with its admission policy if not the default)."""
        return run_label(self.policy, self.admission)

    @property
    def is_hierarchy(self) -> bool:
        """True for runs over more than one tier."""
        return len(self.tiers) > 1

    @property
    def key(self) -> tuple:
        """What identifies a run within a report (two runs with one key are the same run)."""
        shape = tuple((t.name, t.capacity_blocks) for t in self.tiers)
        return (self.policy, self.admission, self.semantics, self.mode, self.capacity_blocks, shape)


@dataclass(frozen=True)
class ReportData:
    """Everything a report shows: the trace, the presets, the runs, and how they were made.

    Invariants: at least one run; runs sorted by semantics, mode, capacity and tier split,
    policies in the order the results files list them; no two runs share a ``key``.
    """

    trace: TraceInfo
    layout: dict | None
    hardware: str | None
    runs: tuple[Run, ...]
    commands: tuple[str, ...]
    sources: tuple[str, ...]
    version: str = ""


def run_label(policy: str, admission: str | None) -> str:
    """``lru``, or ``lru+second_hit`` when an admission policy other than ``always`` ran."""
    return policy if admission in (None, "", "always") else f"{policy}+{admission}"


def load_results(paths: list[str]) -> ReportData:
    """Reads and merges results documents.

    Raises:
        UserError: a file is missing, empty, not JSON, malformed, has no runs, or describes
            another trace, layout or hardware than the first file.
    """
    if not paths:
        raise UserError("no results file given")
    return from_documents([_read_document(p) for p in paths], [str(p) for p in paths])


def from_documents(documents: list[dict], sources: list[str]) -> ReportData:
    """Merges parsed results documents (``sources`` name them in messages).

    Raises:
        UserError: as ``load_results``.
    """
    traces = [_parse_trace(doc, src) for doc, src in zip(documents, sources)]
    for doc, src in zip(documents, sources):
        _check_presets(doc, src)
    for doc, trace, src in zip(documents[1:], traces[1:], sources[1:]):
        _check_same_setup(documents[0], traces[0], sources[0], doc, trace, src)
    runs = _merge_runs([_parse_runs(doc, src) for doc, src in zip(documents, sources)], sources)
    commands = tuple(dict.fromkeys(str(d["command"]) for d in documents if d.get("command")))
    return ReportData(
        trace=traces[0],
        layout=documents[0].get("layout"),
        hardware=documents[0].get("hardware"),
        runs=tuple(sorted(runs, key=_sort_key)),
        commands=commands,
        sources=tuple(sources),
        version=str(documents[0].get("tiercache_version", "")),
    )


def _read_document(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{path}: no such results file")
    text = file.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise UserError(f"{path}: the results file is empty (no runs)")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not a JSON results file ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(document, dict):
        raise UserError(f"{path}: not a results document (expected a JSON object with 'trace' and 'runs')")
    return document


def _parse_trace(document: dict, source: str) -> TraceInfo:
    trace = document.get("trace")
    if not isinstance(trace, dict) or "fingerprint" not in trace:
        raise UserError(f"{source}: not a results document (no 'trace' with a 'fingerprint')")
    try:
        return TraceInfo(
            path=str(trace.get("path", "")),
            name=str(trace.get("name") or Path(str(trace.get("path", "trace"))).name),
            fingerprint=str(trace["fingerprint"]),
            requests=int(trace.get("requests", 0)),
            accesses=int(trace.get("accesses", 0)),
            unique_blocks=int(trace.get("unique_blocks", 0)),
        )
    except (TypeError, ValueError) as exc:
        raise UserError(f"{source}: malformed 'trace' entry ({exc})") from None


def _check_presets(document: dict, source: str) -> None:
    layout, hardware = document.get("layout"), document.get("hardware")
    if layout is not None and not (isinstance(layout, dict) and isinstance(layout.get("block_bytes", 0), int)):
        raise UserError(f"{source}: malformed 'layout' (expected null or an object with an integer block_bytes)")
    if hardware is not None and not isinstance(hardware, str):
        raise UserError(f"{source}: malformed 'hardware' (expected null or a preset name)")


def _check_same_setup(first: dict, first_trace: TraceInfo, first_src: str, doc: dict, trace: TraceInfo, src: str) -> None:
    if trace.fingerprint != first_trace.fingerprint:
        raise UserError(
            f"{src} is from another trace than {first_src} (trace {trace.name!r} fingerprint {trace.fingerprint} "
            f"vs {first_trace.name!r} fingerprint {first_trace.fingerprint}); one report compares runs of one trace"
        )
    for what in ("layout", "hardware"):
        if doc.get(what) != first.get(what):
            raise UserError(
                f"{src} used another {what} ({_preset_name(doc.get(what))}) than {first_src} "
                f"({_preset_name(first.get(what))}); modeled bytes and times would not compare"
            )


def _preset_name(value) -> str:
    if isinstance(value, dict):
        return str(value.get("name", "custom"))
    return "none" if value is None else str(value)


def _parse_runs(document: dict, source: str) -> list[Run]:
    runs = document.get("runs")
    if not isinstance(runs, list):
        raise UserError(f"{source}: not a results document (no 'runs' list)")
    if not runs:
        raise UserError(f"{source}: the results file has no runs")
    return [_parse_run(entry, source, i) for i, entry in enumerate(runs, start=1)]


def _parse_run(entry, source: str, index: int) -> Run:
    where = f"{source}: run {index}"
    if not isinstance(entry, dict):
        raise UserError(f"{where}: expected an object")
    missing = [k for k in _REQUIRED_RUN_KEYS if k not in entry]
    if missing:
        raise UserError(f"{where}: missing {', '.join(missing)}")
    try:
        return _build_run(entry)
    except (TypeError, ValueError, KeyError) as exc:
        raise UserError(f"{where}: malformed value ({exc})") from None


def _build_run(entry: dict) -> Run:
    accesses, hits = int(entry["accesses"]), int(entry["hits"])
    return Run(
        policy=str(entry["policy"]),
        admission=str(entry.get("admission") or "always"),
        semantics=str(entry["semantics"]),
        mode=str(entry.get("mode") or "single"),
        capacity_blocks=int(entry["capacity_blocks"]),
        accesses=accesses,
        hits=hits,
        misses=int(entry["misses"]),
        miss_ratio=float(entry["miss_ratio"]),
        hit_ratio=float(entry.get("hit_ratio", hits / accesses if accesses else 0.0)),
        tiers=tuple(_build_tier(t) for t in entry.get("tiers") or ()),
        bytes_moved={str(k): int(v) for k, v in (entry.get("bytes_moved") or {}).items()},
        modeled_seconds={str(k): float(v) for k, v in (entry.get("modeled_seconds") or {}).items()},
        prefill_tokens=_optional(entry.get("prefill_tokens"), int),
        prefill_tokens_saved=_optional(entry.get("prefill_tokens_saved"), int),
        ttft_saved_s=_optional(entry.get("ttft_saved_s"), float),
        wall_seconds=_optional(entry.get("wall_seconds"), float),
    )


def _build_tier(entry: dict) -> TierResult:
    return TierResult(
        name=str(entry["name"]),
        capacity_blocks=int(entry["capacity_blocks"]),
        hits=int(entry.get("hits", 0)),
        evictions=int(entry.get("evictions", 0)),
        demotions=int(entry.get("demotions", 0)),
        promotions=int(entry.get("promotions", 0)),
    )


def _optional(value, kind):
    return None if value is None else kind(value)


def _merge_runs(per_file: list[list[Run]], sources: list[str]) -> list[Run]:
    """Keeps one copy of runs repeated across files; the same run with other counts is an error."""
    merged: dict[tuple, tuple[Run, str]] = {}
    for runs, source in zip(per_file, sources):
        for run in runs:
            seen = merged.get(run.key)
            if seen is None:
                merged[run.key] = (run, source)
            elif (seen[0].hits, seen[0].misses) != (run.hits, run.misses):
                raise UserError(
                    f"{source} and {seen[1]} both hold {run.label} at {run.capacity_blocks} blocks "
                    f"({run.semantics}, {run.mode}) with different counts; replays are deterministic, so one is stale"
                )
    return [run for run, _ in merged.values()]


def _sort_key(run: Run) -> tuple:
    # Policies are not part of the key: the stable sort keeps them in the order the sweep
    # listed them (the --policy order), which is also the legend order.
    return (run.semantics, run.mode, run.capacity_blocks, run.key[-1])
