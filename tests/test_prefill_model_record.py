"""Results record the prefill cost model their modeled times were computed under, and a report
never compares times computed under two models (the flat per-token rate of earlier files
against the FLOPs model with attention)."""

from __future__ import annotations

import json
from pathlib import Path

import xxhash

from tiercache.cli import main
from tiercache.results import read_results
from tiercache.results.hwinfo import LEGACY_PREFILL_MODEL, PREFILL_MODEL

HEAD = Path(__file__).parent / "data" / "mooncake_head.jsonl"
RUN = ["--capacity", "50", "--semantics", "prefix", "--model", "llama-3-8b", "--hardware", "h200-pcie5-nvme4",
       "--workers", "1", "--no-progress"]


def _as_legacy(document: dict) -> dict:
    """``document`` as a file written under the flat per-token model: no ``prefill_model``,
    its digest over the links and prefill speed alone."""
    profile = dict(document["hardware_profile"])
    del profile["prefill_model"], profile["prefill"]  # neither recorded then
    body = json.dumps({"links": profile["links"], "prefill_tokens_per_s": profile["prefill_tokens_per_s"]},
                      sort_keys=True, separators=(",", ":"))
    profile["digest"] = "xxh3-64:" + xxhash.xxh3_64_hexdigest(body.encode())
    return document | {"hardware_profile": profile}


def test_results_name_the_prefill_model_and_a_report_refuses_times_of_another(tmp_path: Path, capsys) -> None:
    new = tmp_path / "new.json"
    assert main(["replay", str(HEAD), *RUN, "--out", str(new)]) == 0
    document = json.loads(new.read_text())
    assert document["hardware_profile"]["prefill_model"] == PREFILL_MODEL
    assert read_results(new).hardware_profile.prefill_model == PREFILL_MODEL
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps(_as_legacy(document)))
    assert read_results(legacy).hardware_profile.prefill_model == LEGACY_PREFILL_MODEL  # its digest still verifies
    capsys.readouterr()
    assert main(["report", str(legacy), str(new), "-o", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"prefill model {PREFILL_MODEL} vs {LEGACY_PREFILL_MODEL}" in err
