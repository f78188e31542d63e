"""Probe q42 of ``tiercache compare`` / ``report``: a trace name cannot close report.md's
code block, plain ``report`` names the runs it counts once, a missing matplotlib is refused
before the sweep."""

from __future__ import annotations

import sys

from test_report import make_document, make_run, write_json
from tiercache.cli import main
from tiercache.report.document import Code, Document, Section
from tiercache.report.markdown import render_markdown

FP = "xxh3-128:" + "c" * 32


def test_a_command_holding_backtick_lines_stays_inside_its_code_block():
    command = "tiercache compare 'c\n```\n# INJECTED <img src=x>\nx.jsonl' -o out"
    text = render_markdown(Document("t", "s", (Section("Reproduce", (Code(command),)),)))
    block = text.split("## Reproduce\n\n", 1)[1]
    fence = block.split("sh\n", 1)[0]
    assert len(fence) > 3 and set(fence) == {"`"}  # longer than the ``` inside, so that line cannot close it
    assert block.rstrip().endswith(fence) and block.count(fence) == 2


def test_plain_report_names_a_copied_results_file_it_counts_once(tmp_path, capsys):
    document = make_document(FP, [make_run(p, 100, m) for p, m in (("lru", 0.9), ("fifo", 0.8), ("belady", 0.6))])
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_json(a, document)
    write_json(b, document)
    assert main(["report", str(a), str(b), "-o", str(tmp_path / "rep")]) == 0
    assert f"{b} duplicates {a}" in capsys.readouterr().err


def test_compare_without_matplotlib_is_refused_before_the_sweep(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    trace = tmp_path / "missing.jsonl"  # never read: the check comes first
    assert main(["compare", str(trace), "--policy", "lru", "--capacity", "10", "-o", str(tmp_path / "o")]) == 2
    assert "matplotlib" in capsys.readouterr().err
