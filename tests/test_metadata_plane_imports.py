"""The metadata plane never imports torch or cupy (DESIGN.md section 3)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import DATA


def test_metadata_plane_and_a_replay_run_without_torch():
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None   # any import of torch now raises ImportError
        sys.modules["cupy"] = None
        import tiercache, tiercache.config, tiercache.keys, tiercache.core, tiercache.policies
        import tiercache.core.manager, tiercache.sim.replay, tiercache.sim.sweep, tiercache.cli
        from tiercache.policies import EVICTION, ADMISSION, get_eviction, get_admission
        for name in EVICTION: get_eviction(name)
        for name in ADMISSION: get_admission(name)
        from tiercache.sim.sweep import run_sweep
        doc = run_sweep({str(DATA / "mooncake_head.jsonl")!r}, ["lru"], [100], ["object"], workers=1, progress=False)
        assert doc["runs"][0]["accesses"] > 0
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
