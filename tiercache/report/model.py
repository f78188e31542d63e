"""Results documents (``results.json``) read, checked and merged into one report's data.

A results document is what ``tiercache replay --out`` and ``run_sweep`` write: the trace's
identity and statistics, the layout and hardware presets, and one entry per replay run.
Several documents merge into one report only when they describe the same trace (same
``trace.fingerprint``) under the same layout and hardware, so every figure compares like
with like.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..config import TraceKind
from ..errors import UserError
from ..policies import PLACEMENT, PREFETCH
from ..results import LayoutInfo, ResultsDocument, RunRecord, TraceInfo, read_results, run_label
from ..results.prefillinfo import PrefillInfo
from ..results.records import legacy_fingerprint

# The report shows the results records as they are: a run is a ``RunRecord``.
Run = RunRecord

__all__ = ["TraceInfo", "Run", "ReportData", "Repeat", "load_results", "read_documents", "distinct_paths", "from_documents",
           "merge_runs", "run_label", "per_layer_block"]


@dataclass(frozen=True)
class ReportData:
    """Everything a report shows: the trace, the presets, the runs, and how they were made.

    Invariants: at least one run; runs sorted by semantics, mode, capacity and tier split,
    policies in the order the results files list them; no two runs share a ``key``.
    """

    trace: TraceInfo
    layout: LayoutInfo | None
    hardware: str | None
    runs: tuple[Run, ...]
    commands: tuple[str, ...]
    sources: tuple[str, ...]
    version: str = ""
    #: How the runs' prefill times were modeled (the first document's ``hardware_profile``: every
    #: document shares it, ``_check_same_prefill``); None without one (an older file, no hardware).
    prefill_model: str | None = None
    prefill: PrefillInfo | None = None
    #: Runs of a file that an earlier file (or the same one) already held, counted once:
    #: ``tiercache report`` names them on stderr, as ``report --across`` does.
    repeats: tuple[Repeat, ...] = ()


def load_results(paths: list[str]) -> ReportData:
    """Reads (strictly, through ``tiercache.results``) and merges results files.

    Raises:
        UserError: a file is missing, empty, not JSON, not a valid results document, or
            describes another trace, layout or hardware than the first file.
    """
    if not paths:
        raise UserError("no results file given")
    return from_documents(read_documents(paths), [str(p) for p in paths])


def read_documents(paths: list[str]) -> list[ResultsDocument]:
    """Reads results files strictly, each once, with the checks that need the policy registry
    (which ``tiercache.results`` sits below): every run's placement and prefetch policy is one
    tiercache knows; a prefetch policy an older file did not record is told where the file's
    own runs show it (``_with_known_prefetch``).

    Raises:
        UserError: a file given twice (a report would count its runs twice), or as
            ``read_results``, or a run with an unknown placement (names the file and run).
    """
    _check_distinct(paths)
    documents = [read_results(p) for p in paths]
    for document, path in zip(documents, paths):
        _check_placements(document, str(path))
    return [_with_known_prefetch(document) for document in documents]


def _with_known_prefetch(document: ResultsDocument) -> ResultsDocument:
    """``document`` with the prefetch policy of its decode runs told where a file of schema 3
    to 6 did not record it (None) but it is known: one file is one sweep, run with one
    ``--prefetch``, and an offline policy (Belady) refuses any prefetch policy but ``none``,
    so a file holding an offline decode run was replayed without prefetch. Otherwise the
    runs stay "not recorded"."""
    from .summary import is_offline  # summary builds on this module

    unknown = [r for r in document.runs if r.prefetch is None]
    if not unknown or not any(is_offline(r.policy) for r in unknown):
        return document
    return replace(document, runs=tuple(replace(r, prefetch="none") if r.prefetch is None else r for r in document.runs))


def distinct_paths(paths: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """``paths`` without those naming (once resolved) a file given earlier, and ``(path,
    first)`` for each left out (``first``: how it was given earlier), both in the order given."""
    seen: dict[Path, str] = {}
    repeated = []
    for path in map(str, paths):
        resolved = Path(path).resolve()
        if resolved in seen:
            repeated.append((path, seen[resolved]))
        else:
            seen[resolved] = path
    return list(seen.values()), repeated


def _check_distinct(paths: list[str]) -> None:
    _, repeated = distinct_paths(paths)
    if repeated:
        path, first = repeated[0]
        raise UserError(f"{path}: results file given twice (as {first!r} and {path!r}); give each file once")


def _check_placements(document: ResultsDocument, source: str) -> None:
    """Every run's placement and (recorded) prefetch policy is a registered one or an
    out-of-tree ``module:Class``."""
    for i, run in enumerate(document.runs, start=1):
        for field, value, table in (("placement", run.placement, PLACEMENT), ("prefetch", run.prefetch, PREFETCH)):
            if value is not None and value.strip().lower() not in table and ":" not in value:
                raise UserError(f"{source}: run {i}: field {field!r} must be one of {', '.join(table)} "
                                f"(or module:Class), got {value!r}")


def from_documents(documents: list[ResultsDocument], sources: list[str]) -> ReportData:
    """Merges results documents (``sources`` name them in messages).

    Raises:
        UserError: the documents describe different traces, layouts or hardware, or hold
            one run with different counts.
    """
    first = documents[0]
    for doc, src in zip(documents[1:], sources[1:]):
        _check_same_setup(first, sources[0], doc, src)
    _check_one_network(documents, sources)
    runs, repeats = merge_runs([doc.runs for doc in documents], sources)
    commands = tuple(dict.fromkeys(d.command for d in documents if d.command))
    return ReportData(
        trace=first.trace,
        layout=first.layout,
        hardware=_hardware_shown(documents),
        runs=tuple(sorted(runs, key=_sort_key)),
        commands=commands,
        sources=tuple(sources),
        version=first.tiercache_version,
        prefill_model=None if first.hardware_profile is None else first.hardware_profile.prefill_model,
        prefill=None if first.hardware_profile is None else first.hardware_profile.prefill,
        repeats=tuple(repeats),
    )


def _check_same_setup(first: ResultsDocument, first_src: str, doc: ResultsDocument, src: str) -> None:
    if legacy_fingerprint(doc.trace.fingerprint) != legacy_fingerprint(first.trace.fingerprint):
        raise UserError(f"{src} and {first_src} fingerprint their traces differently (written by tiercache versions before "
                        "and after trace fingerprints became xxh3-128); re-run the older one to compare them in one report")
    if doc.trace.fingerprint != first.trace.fingerprint:
        raise UserError(
            f"{src} is from another trace than {first_src} (trace {doc.trace.name!r} fingerprint {doc.trace.fingerprint} "
            f"vs {first.trace.name!r} fingerprint {first.trace.fingerprint}); one report compares runs of one trace"
        )
    if doc.layout != first.layout:
        raise UserError(f"{src} used another layout than {first_src} ({_layout_difference(doc.layout, first.layout)}); "
                        f"modeled bytes and times would not compare{_stale_step_bytes(doc, src, first, first_src)}")
    _check_same_hardware(first, first_src, doc, src)


def _check_same_hardware(first: ResultsDocument, first_src: str, doc: ResultsDocument, src: str) -> None:
    """Documents that record their profile's numbers (``hardware_profile``) compare those of
    the machine (links and prefill speed; the network of a fleet's shared tier is the fleet
    run's own, checked by ``_check_one_network``), whatever the profile was called; an older
    file, which records a name alone, compares names."""
    mine, theirs = doc.hardware_profile, first.hardware_profile
    if (mine is None) != (theirs is None) and None not in (doc.hardware, first.hardware):
        older, newer = (src, first_src) if mine is None else (first_src, src)
        raise UserError(f"{older} was written by an older tiercache, which modeled prefill at a flat per-token rate "
                        f"(it records no 'hardware_profile'): its modeled times do not compare with {newer}'s; "
                        "replay it again")
    if mine is not None and theirs is not None:
        if mine.local != theirs.local:
            raise UserError(f"{src} used another hardware ({doc.hardware}: {mine.difference(theirs)}) than {first_src} "
                            f"({first.hardware}); modeled bytes and times would not compare")
        _check_same_prefill(first, first_src, doc, src)
    elif doc.hardware != first.hardware:
        raise UserError(f"{src} used another hardware ({doc.hardware or 'none'}) than {first_src} "
                        f"({first.hardware or 'none'}); modeled bytes and times would not compare")


def _check_same_prefill(first: ResultsDocument, first_src: str, doc: ResultsDocument, src: str) -> None:
    """Documents on one machine modeled prefill with one model's numbers (``hardware_profile.prefill``:
    parameters and query heads; a file that does not record them compares only with another
    that does not)."""
    mine, theirs = doc.hardware_profile.prefill, first.hardware_profile.prefill
    if mine == theirs:
        return
    if mine is None or theirs is None:
        older, newer, known = (src, first_src, theirs) if mine is None else (first_src, src, mine)
        raise UserError(f"{older} does not record the model its prefill times used (written before results recorded "
                        f"params and query heads), {newer} does ({known.text()}); modeled times may not compare: "
                        "replay it again")
    raise UserError(f"{src} modeled prefill with another model ({mine.text()}) than {first_src} ({theirs.text()}); "
                    "modeled times would not compare")


def _check_one_network(documents: list[ResultsDocument], sources: list[str]) -> None:
    """Fleet runs of one report modeled their shared tier over one network: a document
    records one network for all its runs, so runs under two could not be told apart. Only
    documents with a shared tier (``_shared_network``) are compared, by their network links
    (the numbers the times came from), whatever the network was called."""
    seen = []
    for doc, src in zip(documents, sources):
        network = _shared_network(doc)
        if network is not None and all(network.links != other.links for other, _ in seen):
            seen.append((network, src))
    if len(seen) > 1:
        (a, a_src), (b, b_src) = seen[:2]
        raise UserError(f"{b_src} modeled its shared tier over another network ({b.name}) than {a_src} ({a.name}); "
                        "one report compares fleet runs over one network")


def _shared_network(doc: ResultsDocument):
    """The network ``doc``'s fleet runs modeled their shared tier over, or None: a document
    without a fleet run over a shared tier has none to compare (a one-engine replay under a
    profile JSON that gives network links records them, but has no shared tier)."""
    network = doc.hardware_profile.network if doc.hardware_profile else None
    if network is None or not any(run.is_fleet and _has_remote(run) for run in doc.runs):
        return None
    return network


def _has_remote(run) -> bool:
    return any(t.name == "remote" for t in run.tiers)


def _hardware_shown(documents: list[ResultsDocument]) -> str | None:
    """The hardware a report names: the first document's, by its machine's name and, where
    fleet runs modeled a shared tier, that network (``h200-pcie5-nvme4, shared tier over tcp-25g``)."""
    first = documents[0].hardware_profile
    if first is None:
        return documents[0].hardware
    networks = [network for d in documents if (network := _shared_network(d)) is not None]
    return f"{first.name}, shared tier over {networks[0].name}" if networks else first.name


#: The fields of a recorded layout a message names where two differ.
_LAYOUT_FIELDS = ("name", "layers", "kv_heads", "head_dim", "dtype", "block_tokens", "block_bytes")


def per_layer_block(layout: LayoutInfo) -> bool:
    """Whether ``layout``'s recorded block holds one layer's KV (its bytes are the whole
    model's block over the layer count: a step trace's block), not every layer's (a request
    trace's, and a step trace's in files written before step-trace blocks were charged one
    layer's bytes)."""
    return layout.layers > 1 and layout.one_layer


def _layout_difference(layout: LayoutInfo | None, other: LayoutInfo | None) -> str:
    """``block_bytes 2097152 (every layer's KV) vs 65536 (one layer's KV)``: the fields in
    which two recorded layouts differ, first's value first, or the names where one is none."""
    if layout is None or other is None:
        return f"{layout.name if layout else 'none'} vs {other.name if other else 'none'}"
    parts = []
    for field in _LAYOUT_FIELDS:
        mine, theirs = getattr(layout, field), getattr(other, field)
        if mine != theirs:
            if field == "block_bytes":
                mine, theirs = f"{mine} ({_scope(layout)})", f"{theirs} ({_scope(other)})"
            parts.append(f"{field} {mine} vs {theirs}")
    return f"{layout.name}: " + ", ".join(parts)


def _scope(layout: LayoutInfo) -> str:
    return "one layer's KV" if per_layer_block(layout) else "every layer's KV"


def _stale_step_bytes(doc: ResultsDocument, src: str, first: ResultsDocument, first_src: str) -> str:
    """The sentence saying which file of a step trace charged a block the whole model's KV
    (written before step-trace blocks were charged one layer's: stale), where the two
    layouts differ in that alone; empty otherwise."""
    a, b = doc.layout, first.layout
    if doc.trace.kind is not TraceKind.STEPS or a is None or b is None or per_layer_block(a) == per_layer_block(b):
        return ""
    if any(getattr(a, f) != getattr(b, f) for f in _LAYOUT_FIELDS if f != "block_bytes"):
        return ""
    stale = src if per_layer_block(b) else first_src
    return (f". {stale} charged each block of this step trace the whole model's KV ({a.layers} layers; a step trace's "
            "block is one layer's): it was written before step-trace blocks were charged one layer's bytes, so its bytes "
            "and modeled seconds are the layer count too high; re-run it")


@dataclass(frozen=True)
class Repeat:
    """Runs of one file that a file before it (or itself, earlier) already held, counted once.

    Invariants: ``0 < runs <= total`` (``total``: the runs the file holds); every repeat has
    the key and the counts (hits, misses) of the run it repeats; ``differ <= runs`` of them
    differ from it in another recorded figure than ``wall_seconds`` (bytes or modeled time
    under another layout or hardware, a tier's counters). ``earlier`` names the files that held
    them first, in the order given.
    """

    source: str
    earlier: tuple[str, ...]
    runs: int
    total: int
    differ: int


def merge_runs(per_file: list[tuple[Run, ...]], sources: list[str]) -> tuple[list[Run], list[Repeat]]:
    """Keeps one copy (the first given) of runs repeated across files, and says which file
    repeated which.

    Invariant: the merged runs have distinct keys, in the order first given.

    Raises:
        UserError: two files hold one run (key) with different counts (names both files).
    """
    merged: dict[tuple, tuple[Run, str]] = {}
    repeats = []
    for runs, source in zip(per_file, sources):
        earlier: dict[str, None] = {}  # an ordered set
        repeated = differ = 0
        for run in runs:
            seen = merged.get(run.key)
            if seen is None:
                merged[run.key] = (run, source)
                continue
            _check_same_counts(seen, run, source)
            earlier[seen[1]] = None
            repeated += 1
            differ += not _same_record(seen[0], run)
        if repeated:
            repeats.append(Repeat(source, tuple(earlier), repeated, len(runs), differ))
    return [run for run, _ in merged.values()], repeats


def _check_same_counts(seen: tuple[Run, str], run: Run, source: str) -> None:
    if (seen[0].hits, seen[0].misses) == (run.hits, run.misses):
        return
    what = f"{run.label} at {run.capacity_blocks} blocks ({run.semantics.value}, {run.mode.value})"
    if run.prefetch is None:
        raise UserError(f"{source} and {seen[1]} both hold {what} with different counts; their files (results schema "
                        "before 7) do not record the prefetch policy, so they may be replays with different --prefetch, "
                        "or one is stale: re-run them to compare")
    if seen[1] == source:
        raise UserError(f"{source} holds {what} twice with different counts; replays are deterministic, so the file "
                        "mixes runs of different replays (re-run the sweep)")
    raise UserError(f"{source} and {seen[1]} both hold {what} with different counts; replays are deterministic, "
                    "so one is stale")


def _same_record(first: Run, run: Run) -> bool:
    """Whether two runs recorded the same figures (the wall time of a replay varies from one to the next)."""
    return replace(first, wall_seconds=0.0) == replace(run, wall_seconds=0.0)


def _sort_key(run: Run) -> tuple:
    # Policies are not part of the key: the stable sort keeps them in the order the sweep
    # listed them (the --policy order), which is also the legend order.
    # Hierarchies of one total capacity sort by their split (tier shape), each one's runs together.
    return (run.semantics.value, run.mode.value, run.capacity_blocks, run.tier_shape, len(run.instances or ()),
            run.route.value if run.route else "", run.remote_write.value if run.remote_write else "", run.write_hits or 0)
