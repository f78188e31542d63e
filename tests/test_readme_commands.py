"""The README's `tiercache replay` example output is what the command prints, and its report
commands run as written (issue 8, item 19)."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path


from tiercache.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    start = README.index(title)
    return README[start:README.index("\n#", start + len(title))]


def _blocks(text: str) -> list[str]:
    return re.findall(r"```\n(.*?)```", text, flags=re.S)


def test_replay_example_output_is_what_replay_prints(capsys, monkeypatch):
    block = next(b for b in _blocks(_section("## What you get")) if b.startswith("$ tiercache replay"))
    command, *expected = block.splitlines()
    monkeypatch.chdir(ROOT)
    assert main(shlex.split(command)[2:] + ["--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines() == expected


def test_report_section_commands_run(tmp_path, monkeypatch):
    """Each command of the report section, on the bundled trace's head (the same options, faster)."""
    block = _blocks(_section("### `tiercache compare` and `tiercache report`"))[0]
    (tmp_path / "tests" / "data").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "data" / "mooncake_head.jsonl", tmp_path / "tests" / "data" / "mooncake_synthetic_trace.jsonl")
    monkeypatch.chdir(tmp_path)
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert [c[1] for c in commands] == ["compare", "replay", "replay", "report"]
    for words in commands:
        extra = ["--no-progress"] if words[1] in ("compare", "replay") else []
        assert main(words[1:] + extra) == 0, words
    markdown = (tmp_path / "report-tiered" / "report.md").read_text()
    assert "Does the hierarchy pay off against HBM alone?" in markdown
    assert (tmp_path / "report" / "index.html").is_file()


def test_fleet_section_output_is_what_replay_prints_and_its_report_runs(tmp_path, monkeypatch, capsys):
    """The fleet replay of the README on the sample trace prints the README's figures, and the
    report command after it shows the per-instance and shared-tier table."""
    section = _section("### Fleet replay: sizing a shared tier for a fleet")
    commands, printed = _blocks(section)[:2]
    (tmp_path / "tests" / "data").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "data" / "mooncake_synthetic_trace.jsonl", tmp_path / "tests" / "data")
    monkeypatch.chdir(tmp_path)
    replay, report = (shlex.split(line) for line in commands.splitlines() if line.strip())
    assert replay[1:2] == ["replay"] and "--instances" in replay and report[1:2] == ["report"]
    assert main(replay[1:]) == 0
    assert capsys.readouterr().out.splitlines() == printed.splitlines()
    assert main(report[1:]) == 0
    markdown = (tmp_path / "fleet-report" / "report.md").read_text()
    assert "| instance | requests | hbm hits | dram hits | remote hits |" in markdown and "private tiers alone" in markdown
