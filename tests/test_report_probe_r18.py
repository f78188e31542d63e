"""Review R18 finding 2: ``report --across`` paired halves by recorded trace path and request
counts alone, so the first half of one trace and the second half of another trace written to
the same path (regenerated between two ``compare --split`` runs) became one split row: gaps.md
then showed another trace's pick as "tuned on 1st half". Halves now pair only where they are
shown to be one split's: the first half is the results_first_half.json beside the second half's
file, both record one command, and the trace file, where it lies at its path, does not tell
them apart by their fingerprints."""

from __future__ import annotations

import shutil
from pathlib import Path

from tiercache.cli import main

QUIET = ["--workers", "1", "--no-progress"]
PAIRED = "is the first half of the split whose second half is"


def _synth(trace: Path, seed: int, zipf: str) -> None:
    assert main(["trace", "synth", "docs", "-o", str(trace), "--docs", "40", "--blocks", "8", "--requests", "400",
                 "--seed", str(seed), "--zipf", zipf]) == 0


def _split(trace: Path, out: Path) -> None:
    assert main(["compare", str(trace), "--split", "--policy", "arc,lfu,sieve,fifo", "--capacity", "60,150", *QUIET,
                 "-o", str(out)]) == 0


def _across(tmp_path: Path, capsys, name: str, *paths: Path) -> tuple[str, str]:
    """gaps.md of ``report --across paths`` and what it printed on stderr."""
    capsys.readouterr()
    assert main(["report", "--across", *map(str, paths), "-o", str(tmp_path / name)]) == 0
    return (tmp_path / name / "gaps.md").read_text(encoding="utf-8"), capsys.readouterr().err


def test_across_never_pairs_the_halves_of_two_versions_of_a_trace_written_to_one_path(tmp_path, capsys) -> None:
    trace, old, new, kept = tmp_path / "t.jsonl", tmp_path / "old", tmp_path / "new", tmp_path / "kept.json"
    _synth(trace, 1, "1.2")
    _split(trace, old)
    _split(trace, new)  # the same command, to the folder a later split of another trace overwrites
    shutil.copy(new / "results_first_half.json", kept)
    _synth(trace, 2, "0.3")  # the trace changes at the same path, with as many requests
    _split(trace, new)
    gaps, err = _across(tmp_path, capsys, "other_folder", old / "results_first_half.json", new / "results.json")
    assert PAIRED not in err and "tuned on 1st half" not in gaps
    assert "not the results_first_half.json in the folder of the second half's file" in err
    assert "picked in hindsight" in gaps  # the second half keeps its hindsight row, said why
    shutil.copy(kept, new / "results_first_half.json")  # beside it, one command: only the trace tells them apart
    gaps, err = _across(tmp_path, capsys, "same_folder", new / "results_first_half.json", new / "results.json")
    assert PAIRED not in err and "tuned on 1st half" not in gaps
    assert "the trace changed between the two splits" in err
    _split(trace, new)  # both halves of the trace as it is now
    gaps, err = _across(tmp_path, capsys, "paired", new / "results_first_half.json", new / "results.json")
    assert PAIRED in err and "tuned on 1st half" in gaps
    split_md = (new / "split.md").read_text(encoding="utf-8")
    assert [line for line in gaps.splitlines() if "#second-half" in line] == \
        [line for line in split_md.splitlines() if "#second-half" in line]  # split.md's rows
