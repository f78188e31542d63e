"""The import rule of README "How it is built" (DESIGN.md sections 2 and 3), read statically.

Every module under ``tiercache/``, ``policies/`` (``tiercache.policies``) and ``cuda_ext/``
(``tiercache.cuda_ext``) is parsed with ``ast``; nothing is imported. Each module belongs to a
layer (the first name under ``tiercache``), each layer to a level, and imports only go down:

    level 0  cli  integrations
    level 1  report  live  bench  sim
    level 2  core  data  policies  attention  cuda_ext
    level 3  config  keys  errors  extras  results

A layer may import itself and any lower level; within one level only what
``SAME_LEVEL_ALLOWED`` lists. Nothing imports ``cli`` (but ``tiercache/__main__.py``). The
metadata plane never imports torch or cupy, at module level or inside a function, and never
imports a data-plane layer (which would load torch). ``tiercache/__init__.py`` imports the
data-plane API only lazily. Function-level imports, ``importlib.import_module("...")`` calls
and strings naming one of our modules (lazy tables, the policy registry) count as imports.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from import_graph import ROOT, Import, Module, discover, graph, imports_of

LEVELS = {
    "cli": 0, "integrations": 0,
    "report": 1, "live": 1, "bench": 1, "sim": 1,
    "core": 2, "data": 2, "policies": 2, "attention": 2, "cuda_ext": 2,
    "config": 3, "remote_config": 3, "sizes": 3, "keys": 3, "errors": 3, "extras": 3, "results": 3,
}
BOTTOM = max(LEVELS.values())
PACKAGE_ROOT = "tiercache"  # tiercache/__init__.py: lazy facade, counts as the bottom level
MAIN = "__main__"  # tiercache/__main__.py, the one module that may import cli

# Imports allowed within one level: importing layer -> module prefixes (under ``tiercache.``).
SAME_LEVEL_ALLOWED: dict[str, tuple[str, ...]] = {
    # level 1
    "live": ("sim.steptrace",),  # a live run records a step trace that replays to the same counts
    "bench": ("sim.hardware", "live.cache"),  # measured links saved as a HardwareProfile; decode timing drives the live cache
    "report": ("sim.mrc", "sim.loader"),  # the exact LRU curve: reuse histogram over the trace's ids
    # level 2
    "core": ("policies.base",),  # the manager drives the policy interface, never the registry
    "data": ("core.plans", "core.engine", "core.interrupts", "cuda_ext"),  # executes plans as a TransferEngine; Ctrl-C deferral; kernels
    "attention": ("data", "cuda_ext"),  # decode attention reads tier buffers with the kernels
    # level 3
    "config": ("errors", "sizes", "remote_config"),  # re-exports the capacity spellings and the remote tier's config
    "remote_config": ("errors",),
    "sizes": ("errors", "config"),  # type hints only (TYPE_CHECKING)
    "keys": ("errors",),
    "results": ("errors", "config"),
}

METADATA_PLANE = frozenset({"core", "policies", "sim", "config", "remote_config", "sizes", "keys", "errors", "extras", "results"})
DATA_PLANE = frozenset({"data", "attention", "cuda_ext", "live", "bench", "integrations"})
GPU_MODULES = frozenset({"torch", "cupy"})

def layer_of(name: str) -> str | None:
    """The layer of a dotted module name of ours (``tiercache.sim.replay`` -> ``sim``), the
    package root ``tiercache``, or None for a name outside ``tiercache``."""
    parts = name.split(".")
    if parts[0] != PACKAGE_ROOT:
        return None
    return parts[1] if len(parts) > 1 else PACKAGE_ROOT


def _inside(target: str, prefix: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


def _level(layer: str) -> int:
    return BOTTOM if layer == PACKAGE_ROOT else LEVELS[layer]


def _gpu_violation(edge: Import, source: str) -> str | None:
    """Why an import of torch/cupy by ``source`` (a layer) breaks the rule, or None."""
    if edge.top not in GPU_MODULES:
        return None
    if source in METADATA_PLANE:
        return f"the metadata plane ({source}) never imports {edge.top}, not even inside a function"
    if source == PACKAGE_ROOT and not edge.lazy:
        return f"tiercache/__init__.py imports {edge.top} only lazily"
    return None


def _layer_violation(edge: Import, source: str, target: str) -> str | None:
    """Why ``source`` importing ``edge.target`` (in layer ``target``) breaks the rule, or None."""
    if target not in LEVELS and target != PACKAGE_ROOT:
        return f"{edge.target} is in no layer: add {target!r} to LEVELS"
    if source == target or source == MAIN:
        return None
    if target == "cli":
        return "nothing imports cli (only tiercache/__main__.py)"
    if source == PACKAGE_ROOT:
        return None if edge.lazy or _level(target) == BOTTOM else "tiercache/__init__.py imports this only lazily"
    if source in METADATA_PLANE and target in DATA_PLANE:
        return f"the metadata plane ({source}) never imports the data plane ({target}), which loads torch"
    if _level(target) > _level(source):
        return None
    if _level(target) == _level(source):
        allowed = SAME_LEVEL_ALLOWED.get(source, ())
        if any(_inside(edge.target, f"{PACKAGE_ROOT}.{prefix}") for prefix in allowed):
            return None
        return f"same level ({LEVELS[source]}): {source} may import only {list(allowed)} there"
    return f"imports only go down: {source} (level {LEVELS[source]}) may not import {target} (level {LEVELS[target]})"


def why_broken(edge: Import) -> str | None:
    """The rule ``edge`` breaks, or None when it is allowed (exceptions not applied)."""
    source = layer_of(edge.module)
    if source is None or (source not in LEVELS and source not in (PACKAGE_ROOT, MAIN)):
        return f"module {edge.module} is in no layer: add {source!r} to LEVELS"
    gpu = _gpu_violation(edge, source)
    target = layer_of(edge.target)
    if gpu or target is None:
        return gpu
    return _layer_violation(edge, source, target)


def violations(edges: list[Import]) -> list[str]:
    """``file:line module -> imported: rule`` for every edge that breaks the rule."""
    found = []
    for edge in edges:
        reason = why_broken(edge)
        if reason:
            found.append(f"{edge.describe()}: {reason}")
    return found


def _report(found: list[str]) -> str:
    lines = "\n  ".join(found)
    return (
        f"{len(found)} import(s) break the import rule (README 'How it is built'; "
        f"table in tests/test_import_rule.py):\n  {lines}"
    )


def _synthetic(path: str, source: str) -> list[str]:
    """The violations of a made-up module at ``path`` (relative to the repo) with ``source``."""
    relative = Path(path)
    parts = list(relative.with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    name = ".".join(parts[:-1] if is_package else parts)
    module = Module(name, ROOT / relative, is_package)
    known = {m.name for m in discover()} | {name}
    return violations(imports_of(module, source, known))


def test_every_module_is_in_a_layer():
    unknown = sorted({m.name for m in discover() if layer_of(m.name) not in {*LEVELS, PACKAGE_ROOT, MAIN}})
    assert not unknown, f"modules in no layer (add the package to LEVELS and the README rule): {unknown}"


def test_imports_follow_the_rule():
    found = violations(graph())
    if found:
        pytest.fail(_report(found), pytrace=False)


def test_checker_catches_torch_in_the_metadata_plane():
    found = _synthetic("tiercache/core/x.py", "import numpy\nimport torch\n")
    assert found == ["tiercache/core/x.py:2 tiercache.core.x -> torch: the metadata plane (core) "
                     "never imports torch, not even inside a function"]
    found = _synthetic("tiercache/sim/x.py", "def f():\n    import cupy.cuda\n")
    assert len(found) == 1 and "tiercache.sim.x -> cupy.cuda (function-level)" in found[0]


def test_checker_catches_data_importing_sim():
    found = _synthetic("tiercache/data/y.py", "from tiercache.sim import replay\n")
    assert found == ["tiercache/data/y.py:1 tiercache.data.y -> tiercache.sim.replay: imports only go down: "
                     "data (level 2) may not import sim (level 1)"]


def test_checker_catches_imports_of_cli():
    found = _synthetic("tiercache/sim/z.py", "from tiercache.cli import main\n")
    assert found == ["tiercache/sim/z.py:1 tiercache.sim.z -> tiercache.cli: nothing imports cli "
                     "(only tiercache/__main__.py)"]
    found = _synthetic("tiercache/report/z.py", "import importlib\nimportlib.import_module('tiercache.cli')\n")
    assert len(found) == 1 and "nothing imports cli" in found[0]


def test_checker_resolves_relative_and_same_level_imports():
    assert _synthetic("tiercache/data/w.py", "from ..core.plans import TransferPlan\nfrom . import pools\n") == []
    assert _synthetic("tiercache/live/w.py", "from ..sim import steptrace\nfrom ..data import engine\n") == []
    found = _synthetic("tiercache/live/w.py", "from ..sim.replay import replay\n")
    assert len(found) == 1 and "live may import only ['sim.steptrace'] there" in found[0]
    found = _synthetic("tiercache/core/w.py", "from ..data.pools import BlockPool\n")
    assert len(found) == 1 and "never imports the data plane (data)" in found[0]
    found = _synthetic("tiercache/policies/w.py", "from tiercache.core import manager\n")
    assert len(found) == 1 and "policies may import only []" in found[0]


def test_package_root_imports_the_data_plane_only_lazily():
    lazy = "import importlib\n_LAZY = {'TieredKVStore': 'tiercache.data.pools'}\n"
    assert _synthetic("tiercache/__init__.py", lazy) == []
    found = _synthetic("tiercache/__init__.py", "from tiercache.data.pools import BlockPool\nimport torch\n")
    assert [f.split(": ", 1)[1] for f in found] == ["tiercache/__init__.py imports this only lazily",
                                                    "tiercache/__init__.py imports torch only lazily"]
