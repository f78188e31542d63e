"""The compiled replay's on-disk caches are dropped when any source they depend on changes.

numba keys a cached function on its own file only; a function inlined from another module
(``sim/dispatch.py`` into ``sim/chain.py``) or a module constant read from another module
(``traces.MAX_TOKENS`` in ``sim/fastscan.py``) is frozen into the cache. The stamp
(``policies.kernels.stamped_sources``) must cover every module a compiled module imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tiercache.policies import kernels

ROOT = Path(__file__).resolve().parents[1]
COMPILERS = {"njit", "njit_inline"}


def _compiled_modules() -> list[Path]:
    """Files that import ``njit``/``njit_inline`` from the kernels package (or are in it)."""
    found = []
    for path in sorted((ROOT / "tiercache").rglob("*.py")) + sorted((ROOT / "policies").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and COMPILERS & {a.name for a in node.names}:
                found.append(path)
                break
    return found


def _imported_files(path: Path) -> set[Path]:
    """Files of the package that ``path`` imports from (absolute ``tiercache.`` or relative)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    files = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            parts = (node.module or "").split(".") if node.module else []
            target = base.joinpath(*parts)
        elif node.module and node.module.startswith("tiercache."):
            parts = node.module.split(".")[1:]
            top = ROOT / "policies" if parts[0] == "policies" else ROOT / "tiercache" / parts[0]
            target = top.joinpath(*parts[1:])
        else:
            continue
        for candidate in (target.with_suffix(".py"), target / "__init__.py"):
            if candidate.exists():
                files.add(candidate.resolve())
        for alias in node.names:  # ``from . import leafprio``: a module, not a name
            module = (target / alias.name).with_suffix(".py")
            if module.exists():
                files.add(module.resolve())
    return files


def test_every_module_a_compiled_module_imports_is_stamped():
    stamped = {p.resolve() for p in kernels.stamped_sources()}
    compiled = _compiled_modules()
    assert ROOT / "tiercache" / "sim" / "chain.py" in compiled  # the scan sees the replay's chain
    missing = {str(path.relative_to(ROOT)): sorted(str(f.relative_to(ROOT)) for f in _imported_files(path) - stamped)
               for path in compiled if path.resolve() not in stamped or _imported_files(path) - stamped}
    missing = {k: v for k, v in missing.items() if v or Path(ROOT / k).resolve() not in stamped}
    assert not missing, f"compiled modules or their imports left out of the cache stamp: {missing}"


def test_the_inlined_dispatch_and_the_constants_module_are_stamped():
    """The stamp digest covers ``sim/dispatch.py`` (inlined into the chain): editing it must
    drop the caches (the probe's stale-dispatch finding)."""
    sources = kernels.stamped_sources()
    assert ROOT / "tiercache" / "sim" / "dispatch.py" in [p.resolve() for p in sources]
    assert ROOT / "tiercache" / "sim" / "traces.py" in [p.resolve() for p in sources]
