"""Probe Q24 findings on ``tiercache replay``'s options: ``--out`` never overwrites the
``--hardware`` profile JSON, ``--block-tokens`` is checked whether or not ``--model``/``--layout``
is given, a hardware profile JSON is read as strictly as a trace (no empty name, no repeated or
unknown key), and a codec after a ``--capacity`` value says that codecs belong to ``--tiers``."""

from __future__ import annotations

import json
from pathlib import Path

from tiercache.cli import main
from tiercache.sim.hardware import PRESETS, save_profile

DATA = Path(__file__).parent / "data"
HEAD = DATA / "mooncake_head.jsonl"
QUIET = ["--workers", "1", "--no-progress"]
MODELED = ["--capacity", "3", "--model", "llama-3-8b"]


def _one_error(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def _profile(tmp_path: Path, name: str = "mybox") -> Path:
    """The h200 preset's numbers under a name of its own, as a profile JSON."""
    path = tmp_path / f"{name}.json"
    save_profile(PRESETS["h200-pcie5-nvme4"], path)
    path.write_text(json.dumps(json.loads(path.read_text()) | {"name": name}))
    return path


# ----------------------------------------------------------------------------- finding 1


def test_out_naming_the_hardware_profile_json_is_refused_before_any_work_even_through_a_symlink(
        tmp_path: Path, capsys, monkeypatch) -> None:
    profile = _profile(tmp_path)
    before = profile.read_bytes()
    link = tmp_path / "link.json"
    link.symlink_to(profile)
    monkeypatch.chdir(tmp_path)
    for out, hardware in ((profile, profile), ("mybox.json", profile), (link, profile), (profile, link)):
        err = _one_error(capsys, "replay", HEAD, *MODELED, "--hardware", hardware, "--out", out, *QUIET)
        assert err.startswith(f"tiercache replay: error: --out {out}: is the --hardware profile"), err
        assert profile.read_bytes() == before
    assert main(["replay", str(HEAD), *MODELED, "--hardware", str(profile), "--out", "r.json", *QUIET]) == 0
    assert main(["replay", str(HEAD), *MODELED, "--hardware", "h200-pcie5-nvme4", "--out", "h200-pcie5-nvme4", *QUIET]) == 0


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


# ----------------------------------------------------------------------------- finding 3


def test_a_hardware_profile_json_with_an_empty_name_a_repeated_key_or_an_unknown_field_is_refused_naming_it(
        tmp_path: Path, capsys) -> None:
    good = json.loads(_profile(tmp_path).read_text())
    links = json.dumps(good["links"])
    cases = {
        "empty": (json.dumps(good | {"name": ""}), "'name' must be a non-empty string"),
        "blank": (json.dumps(good | {"name": "  "}), "'name' must be a non-empty string"),
        "dupname": ('{"name": "x", "name": "y", "links": ' + links + ', "prefill_tokens_per_s": 28000}',
                    "key 'name' appears more than once"),
        "duplink": (json.dumps(good).replace('"latency_s"', '"latency_s": 1, "latency_s"', 1),
                    "key 'latency_s' appears more than once"),
        "extra": (json.dumps(good | {"extra": 1}), "unknown field 'extra'"),
    }
    for name, (text, fragment) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        err = _one_error(capsys, "replay", HEAD, *MODELED, "--hardware", path, *QUIET)
        assert err.startswith(f"tiercache replay: error: {path}: ") and fragment in err, err


# ----------------------------------------------------------------------------- finding 4


def test_a_codec_after_a_capacity_value_is_refused_saying_that_codecs_need_tiers(capsys) -> None:
    for capacity, tiers in (("16GiB:int4", "hbm=16GiB:int4"), ("1000,4000:fp8", "hbm=4000:fp8")):
        err = _one_error(capsys, "replay", HEAD, "--capacity", capacity, "--model", "llama-3-8b", *QUIET)
        assert err.startswith("tiercache replay: error: --capacity") and f"--tiers {tiers}" in err, err
        assert "cannot parse" not in err
