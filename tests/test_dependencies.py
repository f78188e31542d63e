"""``pyproject.toml`` declares what is imported, and imports only what it declares.

The third-party imports of the package (``tiercache/``, ``policies/``, ``cuda_ext/``), of
``scripts/`` and of ``tests/`` are read with ``ast`` (``import_graph``), mapped from import
name to distribution name, and checked against ``[project].dependencies`` and the extras:

- the package imports only ``dependencies``, except torch (``cpu`` extra; a GPU machine
  brings its own) and cupy (``gpu`` extra);
- scripts and tests may also use the extras (``test``: pytest, hypothesis, libcachesim);
- every declared distribution is imported somewhere (``DECLARED_AHEAD`` and
  ``LOADED_NOT_IMPORTED``, a pytest plugin, list the exceptions);
- no floor is below the oldest release the suite is known to pass with (``FLOORS``: an older
  one installs, then fails or hangs), and the README names the Python that pyproject requires.
"""

from __future__ import annotations

import re
import tomllib

import pytest

from import_graph import ROOT, Import, discover, graph, stdlib_names

# Import name -> distribution name, where they differ or are not obvious.
IMPORT_TO_DIST = {
    "numpy": "numpy",
    "zarr": "zarr",
    "numcodecs": "numcodecs",
    "google_crc32c": "google-crc32c",
    "xxhash": "xxhash",
    "mooncake": "mooncake-transfer-engine-non-cuda",
    "transformers": "transformers",
    "psutil": "psutil",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
    "numba": "numba",
    "orjson": "orjson",
    "torch": "torch",
    "cupy": "cupy-cuda12x",
    "libcachesim": "libcachesim",
    "pytest": "pytest",
    "hypothesis": "hypothesis",
}
# Imports the package may take from an extra instead of the hard dependencies.
PACKAGE_EXTRAS = {"torch": "cpu", "cupy": "gpu", "mooncake": "remote", "transformers": "hf"}
# Declared but not imported yet, with the reason.
DECLARED_AHEAD = {
    "cupy-cuda12x": "the gpu extra is for cuda_ext's cupy RawModule kernels (DESIGN.md section 2), not landed yet",
}
# Distribution -> (the oldest release known to work, why an older one does not). Probe Q72
# installed each floor pyproject.toml declared and ran the suite.
FLOORS = {
    "python": ("3.11", "zarr 3, numcodecs 0.14 and transformers 5 require it; tests read pyproject with tomllib"),
    "zarr": ("3.0.8", "3.0.0-3.0.7 are yanked; 3.0.0-3.0.2 hang forked readers (test_fork_probe_z4)"),
    "numcodecs": ("0.14", "zarr 3.0.8 requires it"),
    "google-crc32c": ("1.6", "1.5 imports pkg_resources, whose deprecation warning breaks one-line CLI errors"),
    "orjson": ("3.9.15", "older releases parse any depth of nesting (test_cli_errors' deep-nesting trace)"),
    "pytest": ("9.1", "--max-warnings (test_review_probe_r13) is new in 9.1; libcachesim needs 8.4.1"),
}
# Declared, and loaded by a tool rather than imported, with the reason.
LOADED_NOT_IMPORTED = {
    "pytest-xdist": "a pytest plugin: pyproject.toml's addopts run the suite with -n auto (tests/conftest.py)",
}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dist_names(requirements: list[str]) -> set[str]:
    """``["numpy>=1.26", "libcachesim==0.3.5; platform_system == 'Linux'"]`` -> names."""
    return {_normalize(re.match(r"[A-Za-z0-9._-]+", req.strip()).group(0)) for req in requirements}


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    """(``dependencies``, extra name -> its distributions) of pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = {extra: _dist_names(reqs) for extra, reqs in project.get("optional-dependencies", {}).items()}
    return _dist_names(project["dependencies"]), extras


def _third_party(edges: list[Import], local: set[str]) -> list[Import]:
    """The edges that import neither the standard library, tiercache, nor a ``local`` module."""
    skip = stdlib_names() | {"tiercache"} | local
    return [edge for edge in edges if edge.top not in skip]


def _package_edges() -> list[Import]:
    return _third_party(graph(), set())


def _folder_edges(folder: str) -> list[Import]:
    """Third-party edges of the loose ``.py`` files of ``folder`` (scripts/, tests/)."""
    modules = discover({folder: ROOT / folder})
    local = {m.path.stem for m in modules}  # tests import conftest, policy_driver, ... by name
    return _third_party(graph(modules), local)


def _undeclared(edges: list[Import], allowed: set[str], extras_ok: dict[str, str] | None = None) -> list[str]:
    """``file:line module -> import: problem`` for each edge not covered by ``allowed``."""
    _, extras = _declared()
    problems = []
    for edge in edges:
        dist = IMPORT_TO_DIST.get(edge.top)
        if dist is None:
            problems.append(f"{edge.describe()}: unknown import; add it to IMPORT_TO_DIST and pyproject.toml")
        elif _normalize(dist) in allowed:
            continue
        elif extras_ok and edge.top in extras_ok and _normalize(dist) in extras[extras_ok[edge.top]]:
            continue
        else:
            problems.append(f"{edge.describe()}: {dist} is not declared where this code can rely on it")
    return problems


def _everything_declared() -> set[str]:
    dependencies, extras = _declared()
    return dependencies.union(*extras.values())


def test_package_imports_only_declared_dependencies():
    dependencies, _ = _declared()
    problems = _undeclared(_package_edges(), dependencies, PACKAGE_EXTRAS)
    if problems:
        pytest.fail("undeclared imports of the package:\n  " + "\n  ".join(problems), pytrace=False)


def test_scripts_and_tests_import_only_declared_distributions():
    edges = _folder_edges("scripts") + _folder_edges("tests")
    problems = _undeclared(edges, _everything_declared())
    if problems:
        pytest.fail("undeclared imports of scripts/ or tests/:\n  " + "\n  ".join(problems), pytrace=False)


def test_every_declared_distribution_is_imported():
    dependencies, extras = _declared()
    dist_of = {name: _normalize(dist) for name, dist in IMPORT_TO_DIST.items()}
    by_package = {dist_of.get(edge.top) for edge in _package_edges() + _folder_edges("scripts")}
    by_tests = {dist_of.get(edge.top) for edge in _folder_edges("tests")}
    unused = sorted(dependencies - by_package - set(DECLARED_AHEAD))
    assert not unused, f"declared in [project].dependencies but imported by no module or script: {unused}"
    unused = sorted(_everything_declared() - by_package - by_tests - set(DECLARED_AHEAD) - set(LOADED_NOT_IMPORTED))
    assert not unused, f"declared in an extra but imported nowhere: {unused}"


def test_checker_flags_an_undeclared_import():
    edges = [Import("tiercache.data.x", "tiercache/data/x.py", 3, "blake3", False),
             Import("tiercache.data.x", "tiercache/data/x.py", 4, "libcachesim", True)]
    dependencies, _ = _declared()
    problems = _undeclared(edges, dependencies, PACKAGE_EXTRAS)
    assert problems == [
        "tiercache/data/x.py:3 tiercache.data.x -> blake3: unknown import; add it to IMPORT_TO_DIST and pyproject.toml",
        "tiercache/data/x.py:4 tiercache.data.x -> libcachesim (function-level): libcachesim is not declared "
        "where this code can rely on it",
    ]


def test_device_check_installs_from_pyproject():
    script = (ROOT / "scripts" / "device_check.sh").read_text(encoding="utf-8")
    installs = [line for line in script.splitlines() if "pip install" in line]
    assert installs, "scripts/device_check.sh installs nothing"
    assert all(".[" in line for line in installs), f"install from pyproject extras, not a hand-kept list: {installs}"
    assert any(".[test]" in line for line in installs) and any(".[gpu]" in line for line in installs)


def _version(text: str) -> tuple[int, ...]:
    """``"3.0.8"`` -> ``(3, 0, 8)``; numeric release segments only."""
    return tuple(int(part) for part in re.findall(r"\d+", text))


def _floors() -> dict[str, str]:
    """Distribution (and ``python``) -> the version its ``>=`` floor names, wherever declared."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = project["dependencies"] + [r for reqs in project["optional-dependencies"].values() for r in reqs]
    floors = {"python": project["requires-python"].removeprefix(">=")}
    for requirement in requirements:
        match = re.match(r"([A-Za-z0-9._-]+)\s*(?:>=|==)\s*([0-9][0-9.]*)", requirement)
        if match:
            floors[_normalize(match.group(1))] = match.group(2)
    return floors


def test_no_floor_is_below_the_oldest_known_to_work():
    declared = _floors()
    low = [f"{dist}: declared {declared.get(dist)}, needs {oldest} ({why})"
           for dist, (oldest, why) in FLOORS.items() if _version(declared.get(dist, "0")) < _version(oldest)]
    assert not low, "floors below the oldest release known to work:\n  " + "\n  ".join(low)


def test_readme_names_the_python_pyproject_requires():
    python = _floors()["python"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"Python (3\.\d+)\+", readme))
    assert named == {python}, f"README names Python {sorted(named)}+, pyproject requires >={python}"
