"""Probe Q20, finding 2: ``compare`` or ``report`` of runs made with ``--admission`` or
``--placement reuse`` showed no gap closed anywhere ("–" in report.md, "n/a" in gaps.md) and
did not say why, though ``lru+tinylfu`` and ``belady+tinylfu`` (``lru@reuse``, ``belady@reuse``)
over the same tiers were among the runs: only plain lru and belady runs were references."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercache.cli import main
from tiercache.report.summary import gap_text
from tiercache.results import read_results

HEAD = Path(__file__).parent / "data" / "mooncake_head.jsonl"
QUIET = ["--workers", "1", "--no-progress"]
TIERS = ["--tiers", "hbm=100,dram=300"]


def _row(path: Path, start: str) -> list[str]:
    return next(line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith(start)).split(" | ")


@pytest.mark.parametrize("option,value,suffix", [("--admission", "tinylfu", "+tinylfu"), ("--placement", "reuse", "@reuse")])
def test_without_plain_references_the_gap_is_measured_against_lru_and_belady_made_the_same_way_and_labelled_so(
        tmp_path: Path, capsys, option, value, suffix) -> None:
    out = tmp_path / "cmp"
    assert main(["compare", str(HEAD), "--policy", "lru,arc,s3fifo,belady", *TIERS, option, value, "-o", str(out), *QUIET]) == 0
    runs = {r.label: r.miss_ratio for r in read_results(out / "results.json").runs}
    lru, belady = f"lru{suffix}", f"belady{suffix}"
    best = min((label for label in runs if not label.startswith("belady")), key=lambda label: (runs[label], label))
    gap = gap_text((runs[lru] - runs[best]) / (runs[lru] - runs[belady]))
    assert best != lru and gap != "0.0%"  # a case with a gap to close
    row = _row(out / "report.md", "| object | exclusive | 400 |")
    assert row[4:] == [best, f"{100 * runs[best]:.2f}%", f"{100 * runs[lru]:.2f}% ({lru})",
                       f"{100 * runs[belady]:.2f}% ({belady})", f"{gap} |"]
    report = (out / "report.md").read_text(encoding="utf-8")
    assert f"closing {gap} of the {lru}–{belady} gap" in report
    assert (f"the gap closed is measured against the lru and belady runs made with the policy's own admission and "
            f"placement, labelled so: {lru} and {belady}.") in report

    assert main(["report", "--across", str(out / "results.json"), "-o", str(tmp_path / "gaps")]) == 0
    gaps = _row(tmp_path / "gaps" / "gaps.md", "| mooncake_head.jsonl |")
    assert gaps[5:] == [f"{runs[lru]:.6f} ({lru})", f"{runs[belady]:.6f} ({belady})", best, f"{runs[best]:.6f}", f"{gap} |"]
    assert "labelled so in the LRU and Belady columns" in (tmp_path / "gaps" / "gaps.md").read_text(encoding="utf-8")

    # Plain lru and belady runs of the same tiers stay the references wherever they are (as --split adds them).
    plain = str(tmp_path / "plain.json")
    assert main(["replay", str(HEAD), "--policy", "lru,belady", *TIERS, "--out", plain, *QUIET]) == 0
    assert main(["report", str(out / "results.json"), plain, "-o", str(tmp_path / "both")]) == 0
    both = _row(tmp_path / "both" / "report.md", "| object | exclusive | 400 |")
    assert "(" not in both[6] + both[7] and "labelled so" not in (tmp_path / "both" / "report.md").read_text(encoding="utf-8")
    capsys.readouterr()
