"""The one ``results.json`` schema (``records``: the frozen records and the versions;
``reader``: the strict reader of every version; ``files``: reading and writing a file).
Metadata plane."""

from .records import (
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    SPLIT_HALVES,
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
    run_label,
)
from .files import read_results, write_results

__all__ = [
    "SCHEMA_VERSION", "READABLE_VERSIONS", "Semantics", "Mode", "Route", "TraceKind", "TraceInfo", "LayoutInfo", "TierRecord",
    "InstanceRecord", "RunRecord", "ResultsDocument", "run_label", "read_results", "write_results", "SPLIT_HALVES",
]
