"""Probe q27: what ``compare --split`` and ``report --across`` pick and say.

F1: ``report --across`` over a split's results showed the second half's hindsight winner as its
"best online policy" and dropped the policy tuned on the first half (the first half, given too,
became a trace row of its own). F2: ``--split`` could name the plain ``lru`` it adds as a
reference as the policy "tuned on the first half" (and in hindsight), though the user never
offered it. F3: gaps.md rows with ``n/a`` for want of references carried no note.
"""

from __future__ import annotations

from pathlib import Path

from tiercache.cli import main

DATA = Path(__file__).parent / "data"
HEAD = DATA / "mooncake_head.jsonl"
QUIET = ["--workers", "1", "--no-progress"]


def _rows(text: str, start: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(start)]


def _split(tmp_path: Path, trace: Path, *options: str) -> Path:
    out = tmp_path / "split"
    assert main(["compare", str(trace), "--split", *options, *QUIET, "-o", str(out)]) == 0
    return out


def _across(tmp_path: Path, capsys, name: str, *paths: Path) -> tuple[str, str]:
    """gaps.md of ``report --across paths`` and what it printed on stderr."""
    capsys.readouterr()
    assert main(["report", "--across", *map(str, paths), "-o", str(tmp_path / name)]) == 0
    return (tmp_path / name / "gaps.md").read_text(encoding="utf-8"), capsys.readouterr().err


def test_across_pairs_a_splits_halves_into_splitmds_row_and_flags_a_second_half_given_alone(tmp_path, capsys) -> None:
    out = _split(tmp_path, DATA / "mooncake_synthetic_trace.jsonl", "--policy", "session,cost,arc,s3fifo",
                 "--capacity", "4000", "--semantics", "prefix")
    [split_row] = _rows((out / "split.md").read_text(encoding="utf-8"), "| mooncake")
    assert "| session | 0.635079 | 9.7% | cost | 12.8% |" in split_row  # tuned != hindsight here
    gaps, err = _across(tmp_path, capsys, "paired", out / "results_first_half.json", out / "results.json")
    assert _rows(gaps, "| mooncake") == [split_row]  # the first half tunes the row, it is no row of its own
    assert "tunes" in err and "results_first_half.json" in err
    alone, err = _across(tmp_path, capsys, "alone", out / "results.json")
    [row] = _rows(alone, "| mooncake")
    assert "| cost | 0.627132 | 12.8% |" in row
    for text in (alone, err):
        assert "hindsight" in text and "results_first_half.json" in text and "not the policy tuned on the first half" in text


def test_split_picks_the_tuned_and_hindsight_policy_only_among_the_policy_list_not_the_added_lru(tmp_path, capsys) -> None:
    # First half: lru 0.979136 (a reference the command adds), arc+tinylfu = sieve+tinylfu 0.983800.
    out = _split(tmp_path, HEAD, "--policy", "arc,s3fifo,sieve", "--tiers", "hbm=50,dram=300", "--admission", "tinylfu")
    [row] = _rows((out / "split.md").read_text(encoding="utf-8"), "| mooncake")
    cells = [cell.strip() for cell in row.strip("|").split(" | ")]
    assert cells[7] == "arc+tinylfu"  # the tie with sieve+tinylfu goes to the alphabetically first
    assert cells[10] in ("arc+tinylfu", "s3fifo+tinylfu", "sieve+tinylfu")
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "arc+tinylfu, the policy tuned on the first half" in report and "lru, the policy tuned" not in report
    gaps, _ = _across(tmp_path, capsys, "gaps", out / "results_first_half.json", out / "results.json")
    assert _rows(gaps, "| mooncake") == [row]  # report --across chooses among the same policies


def test_across_notes_every_row_whose_gap_is_na_for_want_of_references(tmp_path, capsys) -> None:
    files = []
    for name, options in (("nobelady", ("--policy", "lru,arc,s3fifo", "--capacity", "500")),
                          ("norefs", ("--policy", "arc,s3fifo", "--capacity", "1000")),
                          ("nogap", ("--policy", "lru,arc,belady", "--capacity", "1000000"))):
        files.append(tmp_path / f"{name}.json")
        assert main(["replay", str(DATA / "kvtester_sample"), *options, "--semantics", "prefix", "--out",
                     str(files[-1]), *QUIET]) == 0
    gaps, err = _across(tmp_path, capsys, "gaps", *files)
    assert [row.endswith("| n/a |") for row in _rows(gaps, "| kvtester")] == [True, True, True]
    for text in (gaps, err):
        assert "holds a plain lru run and no belady run" in text  # 500
        assert "no gap closed for arc: these results hold no lru and belady runs" in text and "replay lru and belady over the same" in text  # 1,000
        assert "lru misses no more than belady" in text  # 1,000,000: every miss is a first use
