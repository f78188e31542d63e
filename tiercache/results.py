"""The one ``results.json`` schema: frozen records, a schema version, a strict reader.

A results document is what a sweep produces (``tiercache replay --out``, ``tiercache
compare``) and what ``tiercache report`` reads: the trace's identity and size, the KV layout
and hardware preset (when given), and one record per replay run with every counter the
manager keeps. Metadata plane: no torch, no numpy.

Versions:

* **4** (written now): ``"schema_version": 4``. New against version 3: each tier's
  ``codec`` (how it stores blocks: ``"none"``, ``"int8"``, ``"fp8"``, ``"int4"``) and
  ``block_bytes`` (bytes one block takes in that tier, scales included; null without a
  layout). Transfers touching a quantised tier move its encoded bytes.
* **3**: read with every field version 3 wrote required; the upgrade sets each tier's
  ``codec`` to ``"none"`` (version 3 had no codecs) and ``block_bytes`` to ``None``.
  Every key below is present (a
  value that does not apply is ``null``, or ``{}`` for ``bytes_moved``/``modeled_seconds``
  of runs without a layout). New against version 2: each tier splits its hits into
  ``hits_in_place`` (read where they lie, charged on the link to the top tier) and
  ``hits_promoted``, with ``in_place_bytes``/``promoted_bytes`` (null without a layout) and
  ``in_place_seconds``/``promoted_seconds`` (null without hardware); ``bytes_moved`` and
  ``modeled_seconds`` include the reads in place (version 2 charged them nothing).
* **2**: read with every field version 2 wrote required; the upgrade sets the six fields
  above to ``None`` ("not recorded": version 2 cannot tell them apart). New against
  version 1: each run's ``recomputed``, each tier's ``failed_transfers``,
  ``promote_skipped`` and ``lost``; ``trace.kind`` is spelled ``"requests"``/``"steps"``.
* **1** (files without ``schema_version``, written before the schema was versioned): read
  with every field version 1 wrote required. The upgrade fills only what version 1 did not
  record: the four counters above become ``None`` ("not recorded", never 0); ``trace.kind``
  ``"request"``/``"step"`` map to the enum; keys version 1 wrote only when they applied
  (``bytes_moved``, ``modeled_seconds``, the prefill figures) read as absent: ``{}`` or
  ``None``, exactly as version 2 writes a run without them.

Reading is strict: an unknown version, a missing key or a value of the wrong type raises a
``UserError`` naming the file and, for a run, its 1-based index.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from .config import Codec, KVLayout, Mode, Semantics, TraceKind
from .errors import UserError

__all__ = [
    "SCHEMA_VERSION", "READABLE_VERSIONS", "Semantics", "Mode", "TraceKind", "TraceInfo", "LayoutInfo", "TierRecord",
    "RunRecord", "ResultsDocument", "run_label", "read_results", "write_results",
]

_CODEC_NAMES = tuple(c.value for c in Codec)

#: The version ``ResultsDocument.to_json`` writes.
SCHEMA_VERSION = 4
#: Versions ``ResultsDocument.from_json`` reads (older ones upgraded on reading).
READABLE_VERSIONS = (1, 2, 3, 4)


# Version 1 spelled the trace kinds in the singular.
_V1_TRACE_KINDS = {"request": TraceKind.REQUESTS, "step": TraceKind.STEPS}


@dataclass(frozen=True)
class TraceInfo:
    """Identity and size of the replayed trace.

    Invariants: ``fingerprint`` is the blake2b-128 hex digest of the file's bytes;
    ``requests`` counts requests (request traces) or step records (step traces).
    """

    path: str
    name: str
    fingerprint: str
    kind: TraceKind
    requests: int
    accesses: int
    unique_blocks: int

    @property
    def compulsory_miss_ratio(self) -> float:
        """Misses no cache avoids (first accesses) over accesses, in object semantics."""
        return self.unique_blocks / self.accesses if self.accesses else 1.0

    def to_json(self) -> dict:
        """The ``trace`` object of results.json."""
        return {"path": self.path, "name": self.name, "fingerprint": self.fingerprint, "kind": self.kind.value,
                "requests": self.requests, "accesses": self.accesses, "unique_blocks": self.unique_blocks}


@dataclass(frozen=True)
class LayoutInfo:
    """The KV layout that turned blocks into bytes (``KVLayout`` as recorded)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    block_bytes: int

    @classmethod
    def from_layout(cls, layout: KVLayout) -> "LayoutInfo":
        """The record of ``layout``."""
        return cls(layout.name, layout.layers, layout.kv_heads, layout.head_dim, layout.dtype,
                   layout.block_tokens, layout.block_bytes)

    def to_json(self) -> dict:
        """The ``layout`` object of results.json."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class TierRecord:
    """The counters of one tier in one run (``tiercache.core.stats.TierCounters``).

    Invariants: every count non-negative; ``hits_in_place + hits_promoted == hits`` (the top
    tier's hits are all in place, at no cost). ``failed_transfers``, ``promote_skipped`` and
    ``lost`` are None only in records upgraded from version 1; the hit split only in records
    upgraded from versions 1 and 2; its bytes also without a layout, its seconds without
    hardware. ``codec`` is a ``Codec`` value; ``block_bytes`` (with a layout) the bytes of one
    block in this tier, scales included.
    """

    name: str
    capacity_blocks: int
    hits: int
    inserts: int
    evictions: int
    demotions: int
    promotions: int
    copies: int
    refused: int
    failed_transfers: int | None
    promote_skipped: int | None
    lost: int | None
    hits_in_place: int | None = None
    hits_promoted: int | None = None
    in_place_bytes: int | None = None
    promoted_bytes: int | None = None
    in_place_seconds: float | None = None
    promoted_seconds: float | None = None
    codec: str = "none"
    block_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.codec not in _CODEC_NAMES:
            raise ValueError(f"tier {self.name}: codec {self.codec!r} is not one of {', '.join(_CODEC_NAMES)}")
        split = (self.hits_in_place, self.hits_promoted)
        if None not in split and sum(split) != self.hits:
            raise ValueError(f"tier {self.name}: hits in place {split[0]} + promoted {split[1]} != hits {self.hits}")

    def to_json(self) -> dict:
        """One entry of a run's ``tiers`` list."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class RunRecord:
    """One replay: a policy at a capacity under one semantics and hierarchy mode.

    Invariants: ``accesses == hits + misses``; ``hits`` is the sum of the tiers' hits;
    ``tiers`` fastest first. ``bytes_moved`` (per link) is empty without a layout and
    ``modeled_seconds`` (per link, ``recompute`` and ``total``) without a layout and hardware.
    The prefill figures are None outside prefix semantics (``ttft_saved_s`` also without a
    layout and hardware); ``recomputed`` is None only when upgraded from version 1.
    """

    policy: str
    admission: str
    semantics: Semantics
    mode: Mode
    capacity_blocks: int
    accesses: int
    hits: int
    misses: int
    recomputed: int | None
    miss_ratio: float
    hit_ratio: float
    tiers: tuple[TierRecord, ...]
    wall_seconds: float
    bytes_moved: Mapping[str, int] = field(default_factory=dict)
    modeled_seconds: Mapping[str, float] = field(default_factory=dict)
    prefill_tokens: int | None = None
    prefill_tokens_saved: int | None = None
    ttft_saved_s: float | None = None

    def __post_init__(self) -> None:
        if self.hits + self.misses != self.accesses:
            raise ValueError(f"hits {self.hits} + misses {self.misses} != accesses {self.accesses}")
        if self.tiers and sum(t.hits for t in self.tiers) != self.hits:
            raise ValueError(f"the tiers' hits do not add up to hits {self.hits}")
        object.__setattr__(self, "tiers", tuple(self.tiers))
        # Plain dict copies (not read-only proxies): records cross process boundaries by pickle.
        object.__setattr__(self, "bytes_moved", dict(self.bytes_moved))
        object.__setattr__(self, "modeled_seconds", dict(self.modeled_seconds))

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
        """What identifies a run among others of one trace (two runs with one key are the same run)."""
        shape = tuple((t.name, t.capacity_blocks, t.codec) for t in self.tiers)
        return (self.policy, self.admission, self.semantics, self.mode, self.capacity_blocks, shape)

    def to_json(self) -> dict:
        """One entry of results.json's ``runs`` list (every key present)."""
        record = dict(self.__dict__)
        record |= {"semantics": self.semantics.value, "mode": self.mode.value, "tiers": [t.to_json() for t in self.tiers],
                   "bytes_moved": dict(self.bytes_moved), "modeled_seconds": dict(self.modeled_seconds)}
        return record


def run_label(policy: str, admission: str | None) -> str:
    """``lru``, or ``lru+second_hit`` when an admission policy other than ``always`` ran."""
    return policy if admission in (None, "", "always") else f"{policy}+{admission}"


@dataclass(frozen=True)
class ResultsDocument:
    """A whole results.json: the trace, the presets, the runs, and how they were made.

    Invariants: at least one run. ``schema_version`` is ``SCHEMA_VERSION`` (documents read
    from older files are upgraded on reading, see the module docstring).
    """

    tiercache_version: str
    command: str
    trace: TraceInfo
    layout: LayoutInfo | None
    hardware: str | None
    runs: tuple[RunRecord, ...]
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "runs", tuple(self.runs))
        if not self.runs:
            raise ValueError("a results document holds at least one run")

    def to_json(self) -> dict:
        """The JSON object of results.json (version ``SCHEMA_VERSION``)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "tiercache_version": self.tiercache_version,
            "command": self.command,
            "trace": self.trace.to_json(),
            "layout": None if self.layout is None else self.layout.to_json(),
            "hardware": self.hardware,
            "runs": [run.to_json() for run in self.runs],
        }

    @classmethod
    def from_json(cls, data: Any, source: str) -> "ResultsDocument":
        """Reads a parsed results.json strictly (``source`` names the file in messages).

        Raises:
            UserError: not a results document, an unknown version, or a missing or mistyped
                field (the message names ``source`` and, for a run, its 1-based index).
        """
        return _read_document(data, source)


def read_results(path: str | Path) -> ResultsDocument:
    """Reads and checks one results.json.

    Raises:
        UserError: missing, empty or non-JSON file, or as ``ResultsDocument.from_json``.
    """
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{path}: no such results file")
    text = file.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise UserError(f"{path}: the results file is empty (no runs)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not a JSON results file ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise UserError(f"{path}: not a results file (JSON nested too deeply)") from None
    return ResultsDocument.from_json(data, str(path))


def write_results(path: str | Path, document: ResultsDocument, option: str) -> None:
    """Writes ``document`` as results.json.

    Raises:
        UserError: the file cannot be written (the message names ``option`` and the file).
    """
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(document.to_json(), handle, indent=1)
    except OSError as exc:
        raise UserError(f"{option} {path}: cannot write: {exc.strerror or exc}") from None


# ----------------------------------------------------------------------------- strict reader

_BAD = object()  # what a converter returns for a value of the wrong type

_HIT_SPLIT = ("hits_in_place", "hits_promoted", "in_place_bytes", "promoted_bytes", "in_place_seconds", "promoted_seconds")
# Keys a version did not write (version 1: or wrote only when they applied): their value when absent.
_V3_ABSENT = {"codec": "none", "block_bytes": None}
_V2_ABSENT = _V3_ABSENT | dict.fromkeys(_HIT_SPLIT)
_ABSENT = {4: {}, 3: _V3_ABSENT, 2: _V2_ABSENT, 1: _V2_ABSENT | {
    "recomputed": None, "failed_transfers": None, "promote_skipped": None, "lost": None,
    "bytes_moved": {}, "modeled_seconds": {}, "prefill_tokens": None, "prefill_tokens_saved": None, "ttft_saved_s": None,
}}


def _count(value: Any) -> Any:
    return value if type(value) is int and value >= 0 else _BAD


def _number(value: Any) -> Any:
    return float(value) if type(value) in (int, float) else _BAD


def _text(value: Any) -> Any:
    return value if isinstance(value, str) else _BAD


def _nullable(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else convert(value)


def _mapping(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def read(value: Any) -> Any:
        if not isinstance(value, dict):
            return _BAD
        out = {str(k): convert(v) for k, v in value.items()}
        return _BAD if _BAD in out.values() else out

    return read


def _member(kind: type[enum.Enum], aliases: Mapping[str, enum.Enum] | None = None) -> Callable[[Any], Any]:
    known = {m.value: m for m in kind} | dict(aliases or {})
    return lambda value: known.get(value, _BAD) if isinstance(value, str) else _BAD


_DESCRIPTIONS = {_count: "a non-negative integer", _number: "a number", _text: "a string"}


class _Object:
    """One JSON object being read: typed fields whose errors name the file and the place."""

    def __init__(self, value: Any, parent: str, label: str | None, version: int) -> None:
        if not isinstance(value, dict):
            raise UserError(f"{parent}: malformed {label!r} (expected an object, got {type(value).__name__})")
        self.value, self.version = value, version
        self.where = parent if label is None else f"{parent}: {label}"

    def take(self, key: str, convert: Callable[[Any], Any], description: str = "") -> Any:
        """The converted value of ``key``; absent keys follow the version's rules.

        Raises:
            UserError: the key is missing (and the version requires it) or mistyped.
        """
        if key not in self.value:
            if key in _ABSENT[self.version]:
                return _ABSENT[self.version][key]
            raise UserError(f"{self.where}: missing field {key!r}")
        raw = self.value[key]
        out = convert(raw)
        if out is _BAD:
            raise UserError(f"{self.where}: field {key!r} must be {description or _DESCRIPTIONS[convert]}, got {raw!r}")
        return out

    def require(self, keys: tuple[str, ...]) -> None:
        """Names every missing key at once (a hand-written file may lack several)."""
        missing = [k for k in keys if k not in self.value and k not in _ABSENT[self.version]]
        if missing:
            raise UserError(f"{self.where}: missing field(s) {', '.join(missing)}")


_TIER_COUNTS = ("capacity_blocks", "hits", "inserts", "evictions", "demotions", "promotions", "copies", "refused")
_TIER_COUNTS_V2 = ("failed_transfers", "promote_skipped", "lost")
_RUN_KEYS = ("policy", "admission", "semantics", "mode", "capacity_blocks", "accesses", "hits", "misses",
             "miss_ratio", "hit_ratio", "tiers", "wall_seconds", "recomputed", "bytes_moved", "modeled_seconds",
             "prefill_tokens", "prefill_tokens_saved", "ttft_saved_s")
_LAYOUT_INTS = ("layers", "kv_heads", "head_dim", "block_tokens", "block_bytes")


def _read_version(data: dict, source: str) -> int:
    version = data.get("schema_version", 1)  # files without a version are version 1
    if type(version) is not int or version not in READABLE_VERSIONS:
        known = ", ".join(map(str, READABLE_VERSIONS))
        raise UserError(f"{source}: results schema_version {version!r} is not one this tiercache reads ({known}); "
                        "use the tiercache that wrote it, or rerun the sweep")
    return version


def _read_document(data: Any, source: str) -> ResultsDocument:
    if not isinstance(data, dict):
        raise UserError(f"{source}: not a results document (expected a JSON object with 'trace' and 'runs')")
    version = _read_version(data, source)
    top = _Object(data, source, None, version)
    if not isinstance(data.get("trace"), dict):
        raise UserError(f"{source}: not a results document (no 'trace' object)")
    runs = data.get("runs")
    if not isinstance(runs, list):
        raise UserError(f"{source}: not a results document (no 'runs' list)")
    if not runs:
        raise UserError(f"{source}: the results file has no runs")
    return ResultsDocument(
        tiercache_version=top.take("tiercache_version", _text),
        command=top.take("command", _text),
        trace=_read_trace(_Object(data["trace"], source, "trace", version)),
        layout=_read_layout(top.take("layout", lambda v: v), source, version),
        hardware=top.take("hardware", _nullable(_text), "null or a preset name"),
        runs=tuple(_read_run(entry, source, f"run {i}", version) for i, entry in enumerate(runs, start=1)),
    )


def _read_trace(obj: _Object) -> TraceInfo:
    aliases = _V1_TRACE_KINDS if obj.version == 1 else {}
    kinds = "/".join(aliases or [k.value for k in TraceKind])
    return TraceInfo(
        path=obj.take("path", _text), name=obj.take("name", _text), fingerprint=obj.take("fingerprint", _text),
        kind=obj.take("kind", _member(TraceKind, aliases), kinds),
        requests=obj.take("requests", _count), accesses=obj.take("accesses", _count),
        unique_blocks=obj.take("unique_blocks", _count),
    )


def _read_layout(value: Any, source: str, version: int) -> LayoutInfo | None:
    if value is None:
        return None
    obj = _Object(value, source, "layout", version)
    obj.require(("name", "dtype", *_LAYOUT_INTS))
    ints = {key: obj.take(key, _count) for key in _LAYOUT_INTS}
    return LayoutInfo(name=obj.take("name", _text), dtype=obj.take("dtype", _text), **ints)


def _read_tier(value: Any, parent: str, label: str, version: int) -> TierRecord:
    obj = _Object(value, parent, label, version)
    obj.require(("name", *_TIER_COUNTS, *_TIER_COUNTS_V2, *_HIT_SPLIT, "codec", "block_bytes"))
    counts = {key: obj.take(key, _count) for key in _TIER_COUNTS}
    later = {key: obj.take(key, _nullable(_count), "null or a non-negative integer") for key in _TIER_COUNTS_V2 + _HIT_SPLIT[:4]}
    seconds = {key: obj.take(key, _nullable(_number), "null or a number") for key in _HIT_SPLIT[4:]}
    codec = obj.take("codec", lambda v: v if v in _CODEC_NAMES else _BAD, f"one of {', '.join(_CODEC_NAMES)}")
    block_bytes = obj.take("block_bytes", _nullable(_count), "null or a non-negative integer")
    try:
        return TierRecord(name=obj.take("name", _text), **counts, **later, **seconds, codec=codec, block_bytes=block_bytes)
    except ValueError as exc:
        raise UserError(f"{obj.where}: inconsistent counts: {exc}") from None


def _read_run(value: Any, source: str, label: str, version: int) -> RunRecord:
    obj = _Object(value, source, label, version)
    obj.require(_RUN_KEYS)
    tiers = obj.take("tiers", lambda v: v if isinstance(v, list) else _BAD, "a list of tier objects")
    fields = {
        **{key: obj.take(key, _text) for key in ("policy", "admission")},
        "semantics": obj.take("semantics", _member(Semantics), "/".join(m.value for m in Semantics)),
        "mode": obj.take("mode", _member(Mode), "/".join(m.value for m in Mode)),
        **{key: obj.take(key, _count) for key in ("capacity_blocks", "accesses", "hits", "misses")},
        "recomputed": obj.take("recomputed", _nullable(_count), "null or a non-negative integer"),
        **{key: obj.take(key, _number) for key in ("miss_ratio", "hit_ratio", "wall_seconds")},
        "tiers": tuple(_read_tier(t, obj.where, f"tier {i}", version) for i, t in enumerate(tiers, start=1)),
        "bytes_moved": obj.take("bytes_moved", _mapping(_count), "an object of byte counts per link"),
        "modeled_seconds": obj.take("modeled_seconds", _mapping(_number), "an object of seconds"),
        "prefill_tokens": obj.take("prefill_tokens", _nullable(_count), "null or a non-negative integer"),
        "prefill_tokens_saved": obj.take("prefill_tokens_saved", _nullable(_count), "null or a non-negative integer"),
        "ttft_saved_s": obj.take("ttft_saved_s", _nullable(_number), "null or a number"),
    }
    try:
        return RunRecord(**fields)
    except ValueError as exc:  # the record's own invariants (counts that do not add up)
        raise UserError(f"{obj.where}: inconsistent counts: {exc}") from None
