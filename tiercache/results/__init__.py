"""The one ``results.json`` schema (``records``: the frozen records, the versions, reading
and writing; ``reader``: the strict reader of every version). Metadata plane."""

from .records import (
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    InstanceRecord,
    LayoutInfo,
    Mode,
    ResultsDocument,
    Route,
    RunRecord,
    Semantics,
    TierRecord,
    TraceInfo,
    TraceKind,
    read_results,
    run_label,
    write_results,
)

__all__ = [
    "SCHEMA_VERSION", "READABLE_VERSIONS", "Semantics", "Mode", "Route", "TraceKind", "TraceInfo", "LayoutInfo", "TierRecord",
    "InstanceRecord", "RunRecord", "ResultsDocument", "run_label", "read_results", "write_results",
]
