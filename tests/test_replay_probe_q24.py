"""Probe Q24 findings on ``tiercache replay``'s options: ``--block-tokens`` is checked whether
or not ``--model``/``--layout`` is given."""

from __future__ import annotations

from pathlib import Path

from tiercache.cli import main

QUIET = ["--workers", "1", "--no-progress"]


def _one_error(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


# ----------------------------------------------------------------------------- finding 2


def test_a_bad_block_tokens_on_a_step_trace_is_refused_with_or_without_model(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "st1.jsonl"
    trace.write_text('{"block_tokens": 16}\n{"step": 0, "layer": 0, "read": [], "write": [0, 2]}\n'
                     '{"step": 1, "layer": 0, "read": [0, 2], "write": []}\n')
    for model in ([], ["--model", "llama-3-8b"]):
        for value, fragment in (("0", "[1, 2**31)"), ("-4", "[1, 2**31)"), ("32", "names 16 tokens per block")):
            err = _one_error(capsys, "replay", trace, "--tiers", "hbm=2,dram=2", "--block-tokens", value, *model, *QUIET)
            assert err.startswith("tiercache replay: error: --block-tokens") and fragment in err, err
    assert main(["replay", str(trace), "--tiers", "hbm=2,dram=2", "--block-tokens", "16", *QUIET]) == 0
