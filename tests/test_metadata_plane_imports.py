"""The metadata plane imports and runs with torch and cupy blocked (DESIGN.md section 3).

One subprocess, where ``sys.modules["torch"] = None`` makes any import of torch (or cupy)
raise, imports every metadata-plane module (found by walking the packages, so a new module is
covered without editing this test) plus the package root and the CLI, loads every registered
policy, computes block keys and runs a small replay through ``tiercache replay``. This replaces
the three subprocess tests that lived here, in ``test_keys.py`` and in
``test_policy_contract.py``; every module they named is still imported (see ``ANCHORS``).
The static side of the rule (no torch import anywhere in these modules, even inside a
function) is ``test_import_rule.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import DATA
from import_graph import discover
from test_import_rule import METADATA_PLANE, layer_of

from tiercache.keys import key_to_int, prefix_keys
from tiercache.policies import ADMISSION, EVICTION, get_admission, get_eviction

# Modules the three former tests imported by name and that stay in the metadata plane: a
# guard that discovery finds them (the CLI subcommand modules in sim/ are covered while they
# live there, and through ``tiercache.cli`` once they move into it).
ANCHORS = (
    "tiercache", "tiercache.cli", "tiercache.config", "tiercache.keys", "tiercache.core",
    "tiercache.core.manager", "tiercache.policies", "tiercache.sim.replay", "tiercache.sim.sweep",
    "tiercache.sim.traces", "tiercache.sim.steptrace", "tiercache.sim.synth", "tiercache.sim.oracle",
    "tiercache.sim.hardware",
)
KEY_TOKENS, KEY_BLOCK, KEY_NAMESPACE = list(range(40)), 16, "torch-free"

_CHILD = textwrap.dedent(
    """
    import importlib, json, sys
    sys.modules["torch"] = None  # any import of torch or cupy now raises ImportError
    sys.modules["cupy"] = None
    modules, trace, out, (tokens, block, namespace) = json.loads(sys.argv[1])
    for name in modules:
        importlib.import_module(name)
    from tiercache.policies import ADMISSION, EVICTION, get_admission, get_eviction
    classes = [get_eviction(n).__name__ for n in EVICTION] + [get_admission(n).__name__ for n in ADMISSION]
    from tiercache.keys import key_to_int, prefix_keys
    keys = prefix_keys(tokens, block, namespace)
    from tiercache.cli import main
    argv = ["replay", trace, "--policy", "lru", "--capacity", "100", "--workers", "1", "--no-progress", "--out", out]
    code = main(argv)
    print(json.dumps({"exit": code, "classes": classes, "keys": [k.hex() for k in keys],
                      "ints": [key_to_int(k) for k in keys]}))
    """
)


def torch_free_modules() -> list[str]:
    """Every module that must import without torch: the metadata plane, the package root and
    the CLI (whose subcommands load torch only when a data-plane command runs)."""
    layers = METADATA_PLANE | {"tiercache", "cli"}
    return [m.name for m in discover() if layer_of(m.name) in layers]


def _run_child(modules: list[str], out: Path) -> dict:
    """Runs ``_CHILD`` with torch and cupy blocked; returns the JSON line it prints last."""
    args = [modules, str(DATA / "mooncake_head.jsonl"), str(out), [KEY_TOKENS, KEY_BLOCK, KEY_NAMESPACE]]
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"failed with torch and cupy blocked:\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_discovery_finds_the_metadata_plane():
    modules = set(torch_free_modules())
    missing = [name for name in ANCHORS if name not in modules]
    assert not missing, f"module discovery missed {missing}"
    assert {"tiercache.policies.lru", "tiercache.core.directory"} <= modules


def test_metadata_plane_imports_and_replays_without_torch(tmp_path):
    child = _run_child(torch_free_modules(), tmp_path / "results.json")
    assert child["exit"] == 0
    expected = [get_eviction(n).__name__ for n in EVICTION] + [get_admission(n).__name__ for n in ADMISSION]
    assert child["classes"] == expected, "every registered policy loads without torch"
    keys = prefix_keys(KEY_TOKENS, KEY_BLOCK, KEY_NAMESPACE)
    assert child["keys"] == [k.hex() for k in keys], "block keys differ without torch"
    assert child["ints"] == [key_to_int(k) for k in keys]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert runs and runs[0]["accesses"] > 0, "the replay without torch replayed nothing"
