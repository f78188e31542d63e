"""Probe R15, finding 2: a merged report scored runs made with ``--admission tinylfu`` against
``lru+tinylfu`` and ``belady+tinylfu`` whenever the plain lru/belady *pair* was incomplete, so in
a cache that also held a plain ``lru`` run, ``arc+tinylfu`` was credited with "13.0%" of a gap
though it missed more than that plain ``lru``; and a run that missed less than a Belady made
behind an admission filter was marked "(beats belady)" with the note on hierarchies, as if it
had beaten the plain Belady's replay."""

from __future__ import annotations

import json
from pathlib import Path

from tiercache.cli import main
from tiercache.results import read_results

HEAD = Path(__file__).parent / "data" / "mooncake_head.jsonl"
QUIET = ["--workers", "1", "--no-progress"]
TIERS = ["--tiers", "hbm=100,dram=300"]


def _row(path: Path, start: str) -> list[str]:
    return next(line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith(start)).split(" | ")


def _with_belady_as(source: Path, target: Path, policy: str) -> None:
    """``source`` with the belady+tinylfu run's counts replaced by ``policy``'s (a weaker Belady)."""
    document = json.loads(source.read_text(encoding="utf-8"))
    runs = {run["policy"]: run for run in document["runs"]}
    for field in ("hits", "misses", "miss_ratio", "hit_ratio", "tiers"):
        runs["belady"][field] = runs[policy][field]
    target.write_text(json.dumps(document), encoding="utf-8")


def test_admission_runs_get_no_gap_beside_a_plain_lru_and_a_filtered_belady_beaten_is_named_as_no_bound(
        tmp_path: Path, capsys) -> None:
    filtered = tmp_path / "tl"
    assert main(["compare", str(HEAD), "--policy", "lru,arc,s3fifo,belady", *TIERS, "--admission", "tinylfu",
                 "-o", str(filtered), *QUIET]) == 0
    plain = str(tmp_path / "plain.json")
    assert main(["replay", str(HEAD), "--policy", "lru,arc", *TIERS, "--out", plain, *QUIET]) == 0
    runs = {r.label: r.miss_ratio for r in read_results(filtered / "results.json").runs}
    runs |= {r.label: r.miss_ratio for r in read_results(plain).runs}
    assert runs["arc+tinylfu"] > runs["lru"]  # worse than the plain lru of the same cache

    # A plain lru without a plain belady: no run there is scored against lru+tinylfu (was 13.0%).
    assert main(["report", str(filtered / "results.json"), plain, "-o", str(tmp_path / "mixed")]) == 0
    report = (tmp_path / "mixed" / "report.md").read_text(encoding="utf-8")
    for label in ("arc+tinylfu", "s3fifo+tinylfu", "lru+tinylfu", "belady+tinylfu", "arc"):
        assert _row(tmp_path / "mixed" / "report.md", f"| {label} | object | exclusive | 400 |")[9] == "–", label
    assert "1 cache holds a plain lru run without a plain belady one (or the reverse)" in report
    assert "labelled so" not in report and "beats" not in report.replace("beats lru here", "")
    assert main(["report", "--across", str(filtered / "results.json"), plain, "-o", str(tmp_path / "gaps")]) == 0
    assert _row(tmp_path / "gaps" / "gaps.md", "| mooncake_head.jsonl |")[5:] == [
        f"{runs['lru']:.6f}", "n/a", "lru", f"{runs['lru']:.6f}", "n/a |"]
    assert "holds a plain lru run without a plain belady one" in capsys.readouterr().err

    # Only filtered runs, with a Belady that a policy beats: named as that reference, no bound.
    weaker = tmp_path / "weaker.json"
    _with_belady_as(filtered / "results.json", weaker, "s3fifo")
    assert main(["report", str(weaker), "-o", str(tmp_path / "weak")]) == 0
    report = (tmp_path / "weak" / "report.md").read_text(encoding="utf-8")
    assert _row(tmp_path / "weak" / "report.md", "| arc+tinylfu | object | exclusive | 400 |")[9].endswith(
        "% (beats belady+tinylfu)")
    assert "(beats belady)" not in report and "offline optimum only in one tier in object semantics (in" not in report
    assert "it misses less than belady+tinylfu, Belady's replay with that admission and placement, which is no bound" in report
    assert "Such a belady (Belady's MIN behind an admission filter, or with a placement other than top) is no bound" in report
    assert main(["report", "--across", str(weaker), "-o", str(tmp_path / "weak-gaps")]) == 0
    gaps = (tmp_path / "weak-gaps" / "gaps.md").read_text(encoding="utf-8")
    assert _row(tmp_path / "weak-gaps" / "gaps.md", "| mooncake_head.jsonl |")[-1].endswith("(beats belady+tinylfu) |")
    assert "Such a belady" in gaps and "offline optimum only in one tier" not in gaps
    capsys.readouterr()
