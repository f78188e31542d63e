"""Report building from hand-made results documents: HTML, Markdown, CSV, errors, atomic writes."""

from __future__ import annotations

import base64
import csv
import io
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image
import pytest

from tiercache.cli import main
from tiercache.errors import UserError
from tiercache.report import writer
from tiercache.report.markdown import escape_markdown
from tiercache.report.model import from_documents, load_results
from tiercache.results import ResultsDocument
from tiercache.report.summary import best_per_capacity, gap_closed
from tiercache.report.writer import MARKER

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
POLICIES = ("lru", "fifo", "s3fifo", "belady")
# Miss ratios by policy and capacity: belady best, s3fifo between, fifo worse than lru at 100.
MISS = {"lru": (0.9, 0.7, 0.5), "fifo": (0.95, 0.7, 0.55), "s3fifo": (0.85, 0.65, 0.45), "belady": (0.6, 0.45, 0.4)}
CAPACITIES = (100, 400, 1600)
ACCESSES = 10_000


def make_run(policy: str, capacity: int, miss_ratio: float, semantics: str = "object", tiers=None) -> dict:
    """One run entry as ``tiercache replay`` wrote it before results were versioned (version 1,
    with a layout and hardware known); ``make_document`` reads as an upgraded version-1 file."""
    misses = round(miss_ratio * ACCESSES)
    hits = ACCESSES - misses
    tiers = tiers or [("hbm", capacity, hits)]
    run = {
        "policy": policy, "admission": "always", "semantics": semantics,
        "mode": "single" if len(tiers) == 1 else "exclusive", "capacity_blocks": capacity,
        "accesses": ACCESSES, "hits": hits, "misses": misses, "miss_ratio": misses / ACCESSES, "hit_ratio": hits / ACCESSES,
        "tiers": [{"name": n, "capacity_blocks": c, "hits": h, "inserts": 4, "evictions": 1, "demotions": 2, "promotions": 3,
                   "copies": 0, "refused": 0} for n, c, h in tiers],
        "bytes_moved": {"dram->hbm": 1 << 30, "hbm->dram": 3 << 29} if len(tiers) > 1 else {},
        "modeled_seconds": {"dram->hbm": 0.02, "recompute": misses * 0.018, "total": 0.02 + misses * 0.018},
        "wall_seconds": 0.1234,
    }
    if semantics == "prefix":
        run |= {"prefill_tokens": 5_000_000, "prefill_tokens_saved": hits * 512, "ttft_saved_s": hits * 0.018 - 1.0}
    return run


def make_document(fingerprint: str = "f" * 32, runs: list[dict] | None = None, trace_path: str = "/nonexistent/trace.jsonl") -> dict:
    """A results document over a fictitious trace (so the dense LRU curve is left out)."""
    if runs is None:
        runs = [make_run(p, c, MISS[p][i]) for i, c in enumerate(CAPACITIES) for p in POLICIES]
    return {
        "tiercache_version": "0.1.0",
        "command": "tiercache replay trace.jsonl --policy lru,fifo,s3fifo,belady --capacity 100,400,1600",
        "trace": {"path": trace_path, "name": "my_trace.jsonl", "fingerprint": fingerprint, "kind": "request",
                  "requests": 300, "accesses": ACCESSES, "unique_blocks": 3_500},
        "layout": {"name": "llama-3-8b", "layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16",
                   "block_tokens": 512, "block_bytes": 64 << 20},
        "hardware": "h200-pcie5-nvme4",
        "runs": runs,
    }


def full_document() -> dict:
    """Single-tier object runs, prefix runs, and a three-tier hierarchy: every plot kind."""
    runs = make_document()["runs"]
    runs += [make_run(p, c, MISS[p][i] + 0.02, "prefix") for i, c in enumerate(CAPACITIES) for p in POLICIES]
    for policy in ("lru", "belady"):
        hits = ACCESSES - round(MISS[policy][2] * ACCESSES)
        split = [("hbm", 100, hits // 2), ("dram", 400, hits // 3), ("nvme", 1100, hits - hits // 2 - hits // 3)]
        runs.append(make_run(policy, 1600, MISS[policy][2], tiers=split))
    return make_document(runs=runs)


def write_json(path: Path, document) -> str:
    path.write_text(json.dumps(document))
    return str(path)


def build(tmp_path: Path, document: dict) -> Path:
    out = tmp_path / "report"
    assert main(["report", write_json(tmp_path / "results.json", document), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def full_report(tmp_path_factory) -> tuple[dict, Path]:
    """The report of ``full_document``, built once for the tests that only read it."""
    document = full_document()
    return document, build(tmp_path_factory.mktemp("full"), document)


class _PageParser(HTMLParser):
    """Collects image sources and the cells of every table."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.tables: list[list[list[str]]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def parse_page(out: Path) -> _PageParser:
    parser = _PageParser()
    parser.feed((out / "index.html").read_text(encoding="utf-8"))
    return parser


def table_with(parser: _PageParser, column: str) -> list[dict[str, str]]:
    """The rows of the first table whose header has ``column``."""
    table = next(t for t in parser.tables if t and t[0] and column in t[0])
    return [dict(zip(table[0], row)) for row in table[1:]]


def runs_table(parser: _PageParser) -> list[dict[str, str]]:
    return table_with(parser, "accesses")


def test_html_images_are_embedded_pngs(full_report):
    parser = parse_page(full_report[1])
    # miss ratio x3 (object/prefix single, object exclusive), tiers, movement, prefix savings
    assert len(parser.images) == 6
    for src in parser.images:
        assert src.startswith("data:image/png;base64,")
        png = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert png.startswith(PNG_SIGNATURE)
        pixels = matplotlib.image.imread(io.BytesIO(png), format="png")
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100


def test_every_run_appears_in_the_html_table(full_report):
    document, out = full_report
    rows = runs_table(parse_page(out))
    assert len(rows) == len(document["runs"])
    seen = {(r["policy"], r["semantics"], r["hierarchy"], r["capacity (blocks)"], r["miss ratio"]) for r in rows}
    for run in document["runs"]:
        assert (run["policy"], run["semantics"], run["mode"], f"{run['capacity_blocks']:,}", f"{run['miss_ratio']:.6f}") in seen


def test_markdown_links_resolve_to_files_in_the_folder(full_report):
    out = full_report[1]
    text = (out / "report.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)]+)\)", text)
    assert targets and all(t.endswith(".png") for t in targets)
    for target in targets:
        file = out / target
        assert file.is_file() and file.parent == out
        assert file.read_bytes().startswith(PNG_SIGNATURE)
    assert sorted(p.name for p in out.glob("*.png")) == sorted(set(targets))


def test_report_folder_contents_and_marker(tmp_path):
    out = build(tmp_path, make_document())
    names = {p.name for p in out.iterdir()}
    assert {"index.html", "report.md", "results.csv", MARKER} <= names
    assert "results.json" not in names  # only compare saves its sweep
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind


def test_csv_has_one_row_per_run_with_exact_values(full_report):
    document, out = full_report
    rows = list(csv.DictReader((out / "results.csv").open(encoding="utf-8")))
    assert len(rows) == len(document["runs"])
    by_key = {(r["policy"], r["semantics"], r["mode"], int(r["capacity_blocks"])): r for r in rows}
    for run in document["runs"]:
        row = by_key[(run["policy"], run["semantics"], run["mode"], run["capacity_blocks"])]
        assert (int(row["hits"]), int(row["misses"])) == (run["hits"], run["misses"])
        assert float(row["miss_ratio"]) == run["miss_ratio"]
        assert float(row["seconds_total"]) == run["modeled_seconds"]["total"]


def test_summary_names_best_policy_and_gap(tmp_path):
    out = build(tmp_path, make_document())
    best = next(t for t in parse_page(out).tables if t and t[0] and t[0][0] == "semantics")
    rows = [dict(zip(best[0], r)) for r in best[1:]]
    assert [r["best online policy"] for r in rows] == ["s3fifo"] * 3
    # (0.9 - 0.85) / (0.9 - 0.6) at 100 blocks
    assert rows[0]["gap closed"] == "16.7%"
    assert "compulsory-miss floor" in (out / "report.md").read_text()


def test_gap_closed_and_best_per_capacity():
    data = from_documents([ResultsDocument.from_json(make_document(), "a.json")], ["a.json"])
    best = best_per_capacity(data.runs)
    assert [(b.capacity_blocks, b.best.label) for b in best] == [(100, "s3fifo"), (400, "s3fifo"), (1600, "s3fifo")]
    assert best[1].gap_closed == pytest.approx((0.7 - 0.65) / (0.7 - 0.45))
    lru = next(r for r in data.runs if r.policy == "lru")
    assert gap_closed(lru, lru, lru) is None  # no gap to close


def test_merging_files_of_one_trace(tmp_path):
    document = make_document()
    first, second = dict(document), dict(document)
    first["runs"], second["runs"] = document["runs"][:5], document["runs"][3:]  # runs 3 and 4 in both
    data = load_results([write_json(tmp_path / "a.json", first), write_json(tmp_path / "b.json", second)])
    assert len(data.runs) == len(document["runs"])


@pytest.mark.parametrize(
    "contents, message",
    [
        ("", "empty"),
        ("{not json", "not a JSON results file"),
        ("[]", "not a results document"),
        (json.dumps(make_document(runs=[])), "no runs"),
        (json.dumps(make_document(runs=[{"policy": "lru"}])), "missing"),
        (json.dumps(make_document() | {"layout": "llama"}), "malformed 'layout'"),
    ],
)
def test_bad_results_files_fail_with_a_message(tmp_path, capsys, contents, message):
    (tmp_path / "bad.json").write_text(contents)
    out = tmp_path / "report"
    assert main(["report", str(tmp_path / "bad.json"), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_results_of_different_traces_are_refused(tmp_path, capsys):
    a = write_json(tmp_path / "a.json", make_document(fingerprint="a" * 32))
    b = write_json(tmp_path / "b.json", make_document(fingerprint="b" * 32))
    assert main(["report", a, b, "-o", str(tmp_path / "report")]) == 2
    assert "another trace" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()
    older = write_json(tmp_path / "older.json", make_document(fingerprint="a" * 32))  # blake2b, before xxh3-128
    newer = write_json(tmp_path / "newer.json", make_document(fingerprint="xxh3-128:" + "a" * 32))
    assert main(["report", older, newer, "-o", str(tmp_path / "report")]) == 2
    assert "fingerprint their traces differently" in capsys.readouterr().err


def test_conflicting_counts_for_one_run_are_refused(tmp_path):
    changed = make_document()
    changed["runs"][0] = make_run("lru", 100, 0.5)
    with pytest.raises(UserError, match="different counts"):
        from_documents([ResultsDocument.from_json(d, n) for d, n in ((make_document(), "a.json"), (changed, "b.json"))],
                       ["a.json", "b.json"])


def test_output_folder_that_is_not_a_report_is_left_alone(tmp_path, capsys):
    results = write_json(tmp_path / "results.json", make_document())
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    assert main(["report", results, "-o", str(out)]) == 2
    assert "not a tiercache report" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    assert main(["report", results, "-o", str(tmp_path / "file")]) == 2


def test_previous_report_is_replaced(tmp_path):
    results = write_json(tmp_path / "results.json", make_document())
    out = tmp_path / "report"
    assert main(["report", results, "-o", str(out)]) == 0
    (out / "stale.png").write_bytes(PNG_SIGNATURE)  # a plot the previous report wrote (its marker lists it)
    marker = json.loads((out / MARKER).read_text())
    (out / MARKER).write_text(json.dumps({**marker, "files": [*marker["files"], "stale.png"]}))
    assert main(["report", results, "-o", str(out)]) == 0
    assert not (out / "stale.png").exists() and (out / "index.html").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report", "results.json"]


def test_an_empty_folder_may_receive_a_report(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["report", write_json(tmp_path / "r.json", make_document()), "-o", str(out)]) == 0
    assert (out / "index.html").is_file()


def test_failure_while_writing_leaves_nothing_half_written(tmp_path, monkeypatch):
    results = write_json(tmp_path / "results.json", make_document())
    out = tmp_path / "report"
    assert main(["report", results, "-o", str(out)]) == 0
    before = (out / "index.html").read_bytes()

    def broken(document):
        raise OSError("disk full")

    monkeypatch.setattr(writer, "render_markdown", broken)
    with pytest.raises(OSError):
        main(["report", results, "-o", str(out)])
    assert (out / "index.html").read_bytes() == before  # the previous report is intact
    with pytest.raises(OSError):
        main(["report", results, "-o", str(tmp_path / "new")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report", "results.json"]


def test_text_is_escaped_in_html_and_markdown(tmp_path):
    document = make_document()
    document["trace"]["name"] = "<b>evil</b>_trace|x.jsonl"
    out = build(tmp_path, document)
    page = (out / "index.html").read_text()
    assert "<b>evil</b>" not in page and "&lt;b&gt;evil&lt;/b&gt;" in page
    assert escape_markdown("a_b|c*d") == r"a\_b\|c\*d"
    assert r"\<b>evil\</b>\_trace\|x.jsonl" in (out / "report.md").read_text()


def test_dense_curve_note_when_trace_is_missing(tmp_path):
    out = build(tmp_path, make_document())
    assert "was not found" in (out / "report.md").read_text()


def test_number_formats():
    from tiercache.report import fmt

    assert [fmt.size(b) for b in (512, 1536, 64 << 20, 1000 * (64 << 20))] == ["512 B", "1.5 KiB", "64 MiB", "62.5 GiB"]
    assert [fmt.seconds(s) for s in (1234.5, 12.345, 0.04531)] == ["1,234 s", "12.35 s", "0.0453 s"]
    assert (fmt.integer(121877), fmt.ratio(0.5), fmt.percent(0.4213), fmt.tier("nvme")) == ("121,877", "0.500000", "42.1%", "NVMe")


def test_one_run_of_one_policy_at_one_block_reads_in_the_singular(tmp_path):
    """Probe Q80 nit: "1 replay runs of 1 policies", "At 1 blocks"."""
    results = write_json(tmp_path / "r.json", make_document(runs=[make_run("lru", 1, 0.9)]))
    assert main(["report", results, "-o", str(tmp_path / "rep")]) == 0
    markdown = (tmp_path / "rep" / "report.md").read_text()
    assert "1 replay run of 1 policy (lru) on one trace" in markdown
    assert "1 replay runs" not in markdown and "At 1 blocks" not in markdown


def test_a_time_that_rounds_to_zero_never_reads_minus_zero():
    """Review R46-5: a fleet report showed "-0.0" per instance and in its sentence."""
    from tiercache.report.fleet import tenths

    assert [tenths(v) for v in (-0.04, -0.0, 0.04, -0.06, 1.25)] == ["0.0", "0.0", "0.0", "-0.1", "1.2"]
