"""Probe Q80-3: replacing a previous report's folder deleted what its user had added there
(notes, a folder of backups): the marker proved tiercache made the folder, not that it wrote
everything in it. The marker now lists the report's files; anything else is refused."""

from __future__ import annotations

import json

import pytest

from tiercache.errors import UserError
from tiercache.report.writer import MARKER, write_folder


def test_a_previous_report_is_replaced_when_it_holds_only_its_files(tmp_path):
    out = tmp_path / "r"
    write_folder(str(out), {"report.md": "one", "a.png": b"\x89PNG"}, "1.0")
    assert json.loads((out / MARKER).read_text())["files"] == ["a.png", "report.md"]
    write_folder(str(out), {"report.md": "two"}, "1.0")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "report.md"]
    assert (out / "report.md").read_text() == "two"


@pytest.mark.parametrize("added", ["NOTES.md", "extra/backup.json", "report.txt"])
def test_a_previous_report_holding_what_it_did_not_write_is_refused_untouched(tmp_path, added):
    out = tmp_path / "r"
    write_folder(str(out), {"report.md": "one"}, "1.0")
    (out / added).parent.mkdir(exist_ok=True)
    (out / added).write_text("mine")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    shown = added.split("/")[0]
    with pytest.raises(UserError, match=rf"holds what the report did not write \({shown}\), which replacing it "
                                        r"would delete; move that away, or give another folder$"):
        write_folder(str(out), {"report.md": "two"}, "1.0")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    assert (out / added).read_text() == "mine" and (out / "report.md").read_text() == "one"


def test_a_marker_from_before_the_list_vouches_for_report_files_alone(tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"tiercache_report": 1, "version": "0.9"}) + "\n")
    for name in ("index.html", "report.md", "results.csv", "results.json", "miss_ratio_object_write-through.png",
                 "fleet_3.png", ".DS_Store"):
        (out / name).write_text("old")
    write_folder(str(out), {"report.md": "new"}, "1.0")  # an old report of its own files: replaced
    (out / MARKER).write_text(json.dumps({"tiercache_report": 1}) + "\n")
    (out / "sub").mkdir()
    with pytest.raises(UserError, match=r"did not write \(sub\)"):
        write_folder(str(out), {"report.md": "newer"}, "1.0")


@pytest.mark.parametrize("added", ["notes.md", "my_run.json", "plot.png"])
def test_a_marker_from_before_the_list_vouches_for_no_file_a_report_never_wrote(tmp_path, added):
    """Review R46-3: any .md, .json or .png passed for a report's own under an old marker."""
    out = tmp_path / "r"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"tiercache_report": 1, "version": "0.1.0"}) + "\n")
    (out / "report.md").write_text("old")
    (out / added).write_text("mine")
    with pytest.raises(UserError, match=rf"did not write \({added}\)"):
        write_folder(str(out), {"report.md": "new"}, "1.0")
    assert (out / added).read_text() == "mine"
