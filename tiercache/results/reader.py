"""The strict reader of results.json: every version this tiercache reads, checked field by field.

Errors name the file and, for a run, its 1-based index; absent keys follow the version's
rules (``_ABSENT``: what each older version did not write, read as "not recorded").
Beyond types, values are checked against what a replay can write, so the report never meets
a value it cannot draw: counts below 2**63 (what numpy's int64 holds), capacities of at least
one block, finite seconds (a run's wall time not negative), ratios in [0, 1], tier names
tiercache knows (distinct, fastest first), at least one tier per run, a run's capacity the sum
of its tiers', mode ``single`` exactly for one tier, non-empty policy names, ``decode``
semantics only on a step trace, a prefetch policy other than ``none`` only in ``decode``
semantics, and a trace fingerprint spelled as a replay records it (``xxh3-128:`` and 32
lower-case hex digits, or an earlier version's 32 of blake2b).
Metadata plane: no torch, no numpy.
"""

from __future__ import annotations

import enum
import math
import re
from typing import Any, Callable, Mapping

from ..config import REMOTE_TIER, TIER_NAMES, Codec
from ..errors import UserError
from .consistency import check_run_figures
from .hwinfo import read_hardware_info
from .records import (
    FINGERPRINT_PREFIX, READABLE_VERSIONS, InstanceRecord, LayoutInfo, Mode, RemoteWrite, Route, ResultsDocument, RunRecord,
    Semantics, TierRecord, TraceInfo, TraceKind,
)

__all__ = ["read_document"]

_CODEC_NAMES = tuple(c.value for c in Codec)
# Version 1 spelled the trace kinds in the singular.
_V1_TRACE_KINDS = {"request": TraceKind.REQUESTS, "step": TraceKind.STEPS}


# ----------------------------------------------------------------------------- strict reader

_BAD = object()  # what a converter returns for a value of the wrong type
#: A 128-bit digest as ``hexdigest()`` spells it (the fingerprints' digests).
_HEX_128 = re.compile(r"[0-9a-f]{32}")
#: Counts are held in int64 downstream (numpy, the LRU curve): every count is below this.
_COUNT_LIMIT = 2**63
#: Tier names in hierarchy order (fastest first; the shared remote tier last).
_TIER_ORDER = TIER_NAMES + (REMOTE_TIER,)


class _Refused(Exception):
    """Raised by a converter for a value of the right type but out of range; ``rule`` says
    what the value must be (the error message's ``must be ...``)."""

    def __init__(self, rule: str) -> None:
        super().__init__(rule)
        self.rule = rule


_HIT_SPLIT = ("hits_in_place", "hits_promoted", "in_place_bytes", "promoted_bytes", "in_place_seconds", "promoted_seconds")
# Keys a version did not write (version 1: or wrote only when they applied): their value when absent.
# Versions 3 to 6 could replay with --prefetch without recording it: None ("not recorded"), which
# ``_read_run`` narrows to "none" outside decode semantics; versions 1 and 2 had no prefetch.
# Versions before 8 did not record whether a run's policy is offline: None ("not recorded").
# Version 8 files written before the prefetch counts lack them (optional there): None ("not recorded").
# Versions before 9 wrote through alone: no write mode (None, which a fleet run with a shared tier reads as through).
_PREFETCH_COUNTS = ("prefetched", "prefetch_used", "prefetch_wasted")
_V8_ABSENT = dict.fromkeys(_PREFETCH_COUNTS) | {"remote_write": None, "write_hits": None}
_V7_ABSENT = _V8_ABSENT | {"offline": None}
_V6_ABSENT = _V7_ABSENT | {"prefetch": None}
_V5_ABSENT = _V6_ABSENT | {"placement": "top"}
_V4_ABSENT = _V5_ABSENT | {"instances": None, "route": None, "shared_writes": None}
_V3_ABSENT = _V4_ABSENT | {"codec": "none", "block_bytes": None}
_V2_ABSENT = _V3_ABSENT | dict.fromkeys(_HIT_SPLIT) | {"prefetch": "none"}
_ABSENT = {10: {}, 9: {}, 8: _V8_ABSENT, 7: _V7_ABSENT, 6: _V6_ABSENT, 5: _V5_ABSENT, 4: _V4_ABSENT, 3: _V3_ABSENT, 2: _V2_ABSENT, 1: _V2_ABSENT | {
    "recomputed": None, "failed_transfers": None, "promote_skipped": None, "lost": None,
    "bytes_moved": {}, "modeled_seconds": {}, "prefill_tokens": None, "prefill_tokens_saved": None, "ttft_saved_s": None,
}}


def _count(value: Any) -> Any:
    """A count: an integer in [0, 2**63)."""
    if type(value) is not int or value < 0:
        return _BAD
    if value >= _COUNT_LIMIT:
        raise _Refused("an integer in [0, 2**63)")
    return value


def _positive(value: Any) -> Any:
    """A capacity or layout size: an integer in [1, 2**63)."""
    if type(value) is not int:
        return _BAD
    if not 1 <= value < _COUNT_LIMIT:
        raise _Refused("an integer in [1, 2**63)")
    return value


def _number(value: Any) -> Any:
    """A finite number, as a float (NaN, infinities and integers beyond a float are refused)."""
    if type(value) not in (int, float):
        return _BAD
    try:
        out = float(value)
    except OverflowError:  # an integer beyond the largest float
        out = math.inf
    if not math.isfinite(out):
        raise _Refused("a finite number")
    return out


def _ratio(value: Any) -> Any:
    """A ratio: a number in [0, 1]."""
    out = _number(value)
    if out is not _BAD and not 0.0 <= out <= 1.0:
        raise _Refused("a number in [0, 1]")
    return out


def _duration(value: Any) -> Any:
    """Seconds a run took: a finite number >= 0."""
    out = _number(value)
    if out is not _BAD and out < 0:
        raise _Refused("a number >= 0 (seconds)")
    return out


def _name(value: Any) -> Any:
    """A policy's name: a string with something besides spaces in it, read as a run records it.

    Registered names are matched case-insensitively and recorded in lower case; only an
    out-of-tree policy's name (``module:Class``) has a colon. So a name without one (a
    registered name a file or an older writer spelt otherwise, ``"LRU"``) is read stripped and
    lower-cased, and the report finds its ``lru`` and ``belady`` references whatever the
    spelling; a ``module:Class`` is read stripped, its case kept (module and class names are
    case-sensitive)."""
    if not isinstance(value, str) or not value.strip():
        return _BAD
    return value.strip() if ":" in value else value.strip().lower()


def _flag(value: Any) -> Any:
    """A JSON boolean (not a number standing for one)."""
    return value if type(value) is bool else _BAD


def _tier_name(value: Any) -> Any:
    return value if isinstance(value, str) and value in _TIER_ORDER else _BAD


def _text(value: Any) -> Any:
    return value if isinstance(value, str) else _BAD


def _fingerprint(value: Any) -> Any:
    """A trace fingerprint as a replay records it: ``xxh3-128:`` and the 128-bit digest in
    lower-case hex, or an earlier version's bare blake2b-128 hex digest (``legacy_fingerprint``).
    Any other spelling (empty, upper case, a prefix alone) would name a trace no replay made."""
    if not isinstance(value, str):
        return _BAD
    digest = value[len(FINGERPRINT_PREFIX):] if value.startswith(FINGERPRINT_PREFIX) else value
    return value if _HEX_128.fullmatch(digest) else _BAD


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


_DESCRIPTIONS = {_count: "a non-negative integer", _positive: "a positive integer", _number: "a number", _ratio: "a number",
                 _text: "a string", _duration: "a number"}


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
        try:
            out = convert(raw)
        except _Refused as exc:
            raise UserError(f"{self.where}: field {key!r} must be {exc.rule}, got {raw!r}") from None
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
             "prefill_tokens", "prefill_tokens_saved", "ttft_saved_s", "instances", "route", "shared_writes", "placement",
             "prefetch", "offline", "remote_write", "write_hits")
_INSTANCE_KEYS = ("instance", "requests", "accesses", "hits", "misses", "tier_hits", "bytes_moved", "modeled_seconds",
                  "prefill_tokens_saved", "ttft_saved_s")
_LAYOUT_INTS = ("layers", "kv_heads", "head_dim", "block_tokens", "block_bytes")


def _read_version(data: dict, source: str) -> int:
    version = data.get("schema_version", 1)  # files without a version are version 1
    if type(version) is not int or version not in READABLE_VERSIONS:
        known = ", ".join(map(str, READABLE_VERSIONS))
        raise UserError(f"{source}: results schema_version {version!r} is not one this tiercache reads ({known}); "
                        "use the tiercache that wrote it, or rerun the sweep")
    return version


def read_document(data: Any, source: str) -> ResultsDocument:
    """``ResultsDocument.from_json``: reads a parsed results.json strictly."""
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
    trace = _read_trace(_Object(data["trace"], source, "trace", version))
    records = tuple(_read_run(entry, source, f"run {i}", version) for i, entry in enumerate(runs, start=1))
    _check_semantics_of_kind(records, trace.kind, source)
    _check_accesses_of_trace(records, trace, source)
    return ResultsDocument(
        tiercache_version=top.take("tiercache_version", _text),
        command=top.take("command", _text),
        trace=trace,
        layout=_read_layout(top.take("layout", lambda v: v), source, version),
        hardware=top.take("hardware", _nullable(_text), "null or a preset name"),
        runs=records,
        hardware_profile=read_hardware_info(data.get("hardware_profile"), source),  # optional: older files lack it
    )


def _check_semantics_of_kind(runs: tuple[RunRecord, ...], kind: TraceKind, source: str) -> None:
    """``decode`` semantics is how a step trace replays; a request trace never gives it.

    Raises:
        UserError: a ``decode`` run in a results file of a request trace (names file and run).
    """
    for i, run in enumerate(runs, start=1):
        if run.semantics is Semantics.DECODE and kind is TraceKind.REQUESTS:
            raise UserError(f"{source}: run {i}: semantics 'decode' is how step traces replay, but the trace is a "
                            "request trace (object or prefix semantics)")


def _check_accesses_of_trace(runs: tuple[RunRecord, ...], trace: TraceInfo, source: str) -> None:
    """A replay of a request trace counts every access of it, once; one of a step trace at
    most every access (a write of a block still cached counts none).

    Raises:
        UserError: a run that counted other accesses than its trace holds (names file and run).
    """
    for i, run in enumerate(runs, start=1):
        if run.accesses != trace.accesses if trace.kind is TraceKind.REQUESTS else run.accesses > trace.accesses:
            raise UserError(f"{source}: run {i}: {run.accesses:,} accesses counted, but the {trace.kind.value} trace "
                            f"it replayed holds {trace.accesses:,}: the run is not this trace's")


def _read_trace(obj: _Object) -> TraceInfo:
    aliases = _V1_TRACE_KINDS if obj.version == 1 else {}
    kinds = "/".join(aliases or [k.value for k in TraceKind])
    info = TraceInfo(
        path=obj.take("path", _text), name=obj.take("name", _text),
        fingerprint=obj.take("fingerprint", _fingerprint, f"'{FINGERPRINT_PREFIX}' and 32 lower-case hex digits (xxh3-128), "
                             "or, from a tiercache before it, 32 lower-case hex digits (blake2b-128)"),
        kind=obj.take("kind", _member(TraceKind, aliases), kinds),
        requests=obj.take("requests", _count), accesses=obj.take("accesses", _count),
        unique_blocks=obj.take("unique_blocks", _count),
    )
    if info.unique_blocks > info.accesses:
        raise UserError(f"{obj.where}: inconsistent counts: unique_blocks {info.unique_blocks} > accesses {info.accesses}")
    return info


def _read_layout(value: Any, source: str, version: int) -> LayoutInfo | None:
    if value is None:
        return None
    obj = _Object(value, source, "layout", version)
    obj.require(("name", "dtype", *_LAYOUT_INTS))
    ints = {key: obj.take(key, _positive) for key in _LAYOUT_INTS}
    return LayoutInfo(name=obj.take("name", _text), dtype=obj.take("dtype", _text), **ints)


def _read_tier(value: Any, parent: str, label: str, version: int) -> TierRecord:
    obj = _Object(value, parent, label, version)
    obj.require(("name", *_TIER_COUNTS, *_TIER_COUNTS_V2, *_HIT_SPLIT, "codec", "block_bytes"))
    counts = {key: obj.take(key, _positive if key == "capacity_blocks" else _count) for key in _TIER_COUNTS}
    later = {key: obj.take(key, _nullable(_count), "null or a non-negative integer") for key in _TIER_COUNTS_V2 + _HIT_SPLIT[:4]}
    seconds = {key: obj.take(key, _nullable(_number), "null or a number") for key in _HIT_SPLIT[4:]}
    codec = obj.take("codec", lambda v: v if v in _CODEC_NAMES else _BAD, f"one of {', '.join(_CODEC_NAMES)}")
    block_bytes = obj.take("block_bytes", _nullable(_count), "null or a non-negative integer")
    name = obj.take("name", _tier_name, f"one of {', '.join(_TIER_ORDER)}")
    try:
        return TierRecord(name=name, **counts, **later, **seconds, codec=codec, block_bytes=block_bytes)
    except ValueError as exc:
        raise UserError(f"{obj.where}: inconsistent counts: {exc}") from None


def _read_run(value: Any, source: str, label: str, version: int) -> RunRecord:
    obj = _Object(value, source, label, version)
    obj.require(_RUN_KEYS)
    tiers = obj.take("tiers", lambda v: v if isinstance(v, list) and v else _BAD, "a non-empty list of tier objects")
    records = tuple(_read_tier(t, obj.where, f"tier {i}", version) for i, t in enumerate(tiers, start=1))
    _check_tier_order(records, obj.where)
    semantics = obj.take("semantics", _member(Semantics), "/".join(m.value for m in Semantics))
    fields = {
        **{key: obj.take(key, _name, "a non-empty string (a policy name)") for key in ("policy", "admission", "placement")},
        "semantics": semantics,
        "mode": _read_mode(obj, records),
        "capacity_blocks": _read_capacity(obj, records),
        **{key: obj.take(key, _count) for key in ("accesses", "hits", "misses")},
        "recomputed": obj.take("recomputed", _nullable(_count), "null or a non-negative integer"),
        **{key: obj.take(key, _ratio) for key in ("miss_ratio", "hit_ratio")},
        "wall_seconds": obj.take("wall_seconds", _duration),
        "tiers": records,
        "bytes_moved": obj.take("bytes_moved", _mapping(_count), "an object of byte counts per link"),
        "modeled_seconds": obj.take("modeled_seconds", _mapping(_number), "an object of seconds"),
        "prefill_tokens": obj.take("prefill_tokens", _nullable(_count), "null or a non-negative integer"),
        "prefill_tokens_saved": obj.take("prefill_tokens_saved", _nullable(_count), "null or a non-negative integer"),
        "ttft_saved_s": obj.take("ttft_saved_s", _nullable(_number), "null or a number"),
        "instances": _read_instances(obj),
        "route": _read_route(obj),
        "shared_writes": obj.take("shared_writes", _nullable(_count), "null or a non-negative integer"),
        "prefetch": _read_prefetch(obj, semantics),
        "offline": obj.take("offline", _nullable(_flag), "null or a boolean (whether the policy reads the future)"),
        **{key: obj.take(key, _nullable(_count), "null or a non-negative integer") for key in _PREFETCH_COUNTS},
        "remote_write": _read_remote_write(obj, records),
        "write_hits": obj.take("write_hits", _nullable(_positive), "null or a positive integer"),
    }
    try:
        run = RunRecord(**fields)
    except ValueError as exc:  # the record's own invariants (counts that do not add up)
        raise UserError(f"{obj.where}: inconsistent counts: {exc}") from None
    try:
        check_run_figures(run)
    except ValueError as exc:
        raise UserError(f"{obj.where}: inconsistent figures: {exc}") from None
    return run


def _read_route(run: _Object) -> Route | None:
    """A run's ``route``: a ``Route`` value, or null; ``kv_aware`` only from version 9 on (it
    came with the files of version 9's last days; version 10 is the first to promise it).

    Raises:
        UserError: not null or a route, or ``kv_aware`` in a file older than version 9.
    """
    route = run.take("route", _nullable(_member(Route)), "null or " + "/".join(r.value for r in Route))
    if route is Route.KV_AWARE and run.version < 9:
        raise UserError(f"{run.where}: field 'route' kv_aware is not one schema version {run.version} could record "
                        "(it came with version 9); the file was not written by tiercache as it says")
    return route


def _read_remote_write(run: _Object, tiers: tuple[TierRecord, ...]) -> RemoteWrite | None:
    """A run's ``remote_write``: a ``RemoteWrite`` value, or null. Null on a fleet run with a
    shared tier reads as ``through`` in files before version 9 (the record's default), and is
    refused from version 9 on (every replay with a shared tier records its mode).

    Raises:
        UserError: not null or a mode, or null on a version 9 fleet run with a shared tier.
    """
    modes = "/".join(w.value for w in RemoteWrite)
    write = run.take("remote_write", _nullable(_member(RemoteWrite)), f"null or {modes}")
    shared = run.value.get("instances") is not None and any(t.name == REMOTE_TIER for t in tiers)
    if write is None and shared and run.version >= 9:
        raise UserError(f"{run.where}: field 'remote_write' must be {modes} for a fleet run with a shared remote tier, "
                        "got None")
    return write


def _read_mode(run: _Object, tiers: tuple[TierRecord, ...]) -> Mode:
    """A run's ``mode``: ``single`` exactly for one tier (as every replay and fleet replay writes
    it; a fleet's shared ``remote`` tier counts as a tier), ``exclusive`` or ``write_through``
    for more.

    Raises:
        UserError: not a mode, or one its tiers contradict (names the run).
    """
    mode = run.take("mode", _member(Mode), "/".join(m.value for m in Mode))
    if (mode is Mode.SINGLE) != (len(tiers) == 1):
        want = Mode.SINGLE.value if len(tiers) == 1 else f"{Mode.EXCLUSIVE.value} or {Mode.WRITE_THROUGH.value}"
        raise UserError(f"{run.where}: field 'mode' is {mode.value!r}, but the run has {len(tiers)} tier(s) "
                        f"({', '.join(t.name for t in tiers)}): must be {want}")
    return mode


def _read_capacity(run: _Object, tiers: tuple[TierRecord, ...]) -> int:
    """A run's ``capacity_blocks``: the sum of its tiers' (a fleet's private tiers counted once,
    as one instance's, plus the shared tier), as every replay writes it.

    Raises:
        UserError: not a positive integer, or not the sum of the tiers' (names the run).
    """
    capacity = run.take("capacity_blocks", _positive)
    held = sum(t.capacity_blocks for t in tiers)
    if capacity != held:
        raise UserError(f"{run.where}: field 'capacity_blocks' is {capacity}, but its tiers hold {held} blocks "
                        f"({', '.join(f'{t.name} {t.capacity_blocks}' for t in tiers)}): a run's capacity is the sum "
                        "of its tiers'")
    return capacity


def _read_prefetch(run: _Object, semantics: Semantics) -> str | None:
    """A run's prefetch policy: ``"none"`` or, in ``decode`` semantics only (what a prefetch policy
    plans), a policy name; an upgraded decode run's None ("not recorded") is kept, another's is
    ``"none"``.

    Raises:
        UserError: not a string (null only where an older version did not record it), or a
            policy other than ``none`` outside decode semantics (names the run).
    """
    prefetch = run.take("prefetch", _text, "a string (a prefetch policy, \"none\" for none)")
    if semantics is not Semantics.DECODE:
        if prefetch not in (None, "none"):
            raise UserError(f"{run.where}: field 'prefetch' must be 'none' in {semantics.value} semantics (a prefetch "
                            f"policy plans decode steps), got {prefetch!r}")
        return "none"
    return prefetch


def _check_tier_order(tiers: tuple[TierRecord, ...], where: str) -> None:
    """A run's tiers are distinct and fastest first (``hbm, dram, nvme``, ``remote`` last).

    Raises:
        UserError: a tier repeated or out of order (names the run).
    """
    ranks = [_TIER_ORDER.index(t.name) for t in tiers]
    if any(a >= b for a, b in zip(ranks, ranks[1:])):
        raise UserError(f"{where}: tiers must be distinct and fastest first ({', '.join(_TIER_ORDER)}), "
                        f"got {', '.join(t.name for t in tiers)}")


def _read_instances(run: _Object) -> tuple[InstanceRecord, ...] | None:
    """A fleet run's ``instances`` list (None: a one-engine run)."""
    entries = run.take("instances", _nullable(lambda v: v if isinstance(v, list) and v else _BAD),
                       "null or a non-empty list of instance objects")
    if entries is None:
        return None
    return tuple(_read_instance(e, run.where, f"instance {i}", run.version) for i, e in enumerate(entries, start=1))


def _read_instance(value: Any, parent: str, label: str, version: int) -> InstanceRecord:
    obj = _Object(value, parent, label, version)
    obj.require(_INSTANCE_KEYS)
    fields = {
        **{key: obj.take(key, _count) for key in ("instance", "requests", "accesses", "hits", "misses", "prefill_tokens_saved")},
        "tier_hits": obj.take("tier_hits", _mapping(_count), "an object of hit counts per tier"),
        "bytes_moved": obj.take("bytes_moved", _mapping(_count), "an object of byte counts per link"),
        "modeled_seconds": obj.take("modeled_seconds", _mapping(_number), "an object of seconds per link"),
        "ttft_saved_s": obj.take("ttft_saved_s", _nullable(_number), "null or a number"),
    }
    try:
        return InstanceRecord(**fields)
    except ValueError as exc:
        raise UserError(f"{obj.where}: inconsistent counts: {exc}") from None
