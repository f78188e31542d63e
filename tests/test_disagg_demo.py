"""``scripts/disagg_demo.py`` runs end to end (issue 11): the decode process finds the
prefill process's KV by prefix through the remote tier and decodes the same tokens as a
full recompute."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from remote_helpers import require_mooncake

require_mooncake()
pytest.importorskip("transformers", reason="the demo's tiny Llama needs the hf extra (pip install -e '.[hf]')")

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "disagg_demo.py"


def test_disagg_demo_hands_the_prefill_kv_to_the_decode_process(tmp_path):
    out = tmp_path / "demo.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "520", "--new-tokens", "4", "--repeats", "2",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    produced, consumed = result["prefill"], result["decode"]
    assert produced["blocks"] == produced["published"] == 8  # 520 tokens: 8 full 64-token blocks
    assert consumed["found_tokens"] == 512 and consumed["cached_tokens"] == 512  # the tail (8 tokens) runs
    assert consumed["remote_gets"] == 8 and consumed["bytes_fetched"] == produced["bytes_put"]
    assert consumed["same_tokens"]  # every hand-off decodes exactly what every full recompute does
    assert consumed["repeats"] == 2 and len(consumed["samples"]["handoff"]) == 2
    assert all(run["remote_gets"] == 8 for run in consumed["samples"]["handoff"])  # each timed hand-off fetches remotely
    assert "speed-up (median of per-pair ratios)" in done.stdout


@pytest.mark.parametrize("target", ["parent"])  # "group" passes too (40 s: the master's teardown); run it by hand
def test_sigterm_stops_every_process_of_the_demo_and_removes_its_folders(tmp_path, target):
    """SIGTERM to the demo (or to its process group, as a shell's job control or a batch
    scheduler sends it) ends it with 143 once both children and the master have stopped and
    every NVMe folder they made is removed."""
    import os
    import signal
    import time

    psutil = pytest.importorskip("psutil")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    demo = subprocess.Popen([sys.executable, str(SCRIPT), "--tokens", "520", "--new-tokens", "4", "--repeats", "50"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(scratch)})
    parent = psutil.Process(demo.pid)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and demo.poll() is None:  # until the decode child runs (prefill done)
        if sum("--role" in " ".join(p.cmdline()) for p in parent.children(recursive=True) if p.is_running()) >= 2:
            break
        time.sleep(0.2)
    assert demo.poll() is None, demo.stderr.read()[-3000:]
    family = parent.children(recursive=True)
    time.sleep(1.0)  # the decode process is inside its timed runs
    if target == "parent":
        demo.send_signal(signal.SIGTERM)
    else:
        os.killpg(demo.pid, signal.SIGTERM)
    assert demo.wait(timeout=90) == 143, demo.stderr.read()[-3000:]
    gone, alive = psutil.wait_procs(family, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")] == []  # torch's own cache stays
