"""The static import graph of the repository, read with ``ast`` (nothing is imported).

Shared by the import-rule test, the declared-dependencies test and the torch-free import
test. Modules are named as they are installed: ``policies/`` is ``tiercache.policies`` and
``cuda_ext/`` is ``tiercache.cuda_ext`` (``[tool.setuptools.package-dir]``).
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parents[1]

# Installed package name -> the folder that holds it.
PACKAGE_DIRS = {
    "tiercache": ROOT / "tiercache",
    "tiercache.policies": ROOT / "policies",
    "tiercache.cuda_ext": ROOT / "cuda_ext",
}

# A string literal that names a module of ours, optionally ``:Class`` (lazy tables, registries).
_MODULE_STRING = re.compile(r"^(tiercache(?:\.[A-Za-z_]\w*)+)(?::[A-Za-z_]\w*)?$")
_IMPORT_CALLS = {"import_module", "__import__"}


@dataclass(frozen=True)
class Module:
    """One source file and the dotted name it is imported as."""

    name: str
    path: Path
    is_package: bool

    @property
    def label(self) -> str:
        """The path relative to the repository root, for messages."""
        try:
            return self.path.relative_to(ROOT).as_posix()
        except ValueError:
            return self.path.as_posix()


@dataclass(frozen=True)
class Import:
    """One import edge.

    Attributes:
        module: the importing module's dotted name.
        label: the importing file (relative path) for messages.
        line: line number of the import.
        target: the absolute dotted name imported; ``from a import b`` gives ``a.b`` when
            ``a.b`` is a known module, else ``a``.
        lazy: True when the import runs only when a function is called (inside a function
            body), or is a string naming a module (``importlib.import_module`` tables).
    """

    module: str
    label: str
    line: int
    target: str
    lazy: bool

    @property
    def top(self) -> str:
        """The top-level name of the target (``numpy`` for ``numpy.typing``)."""
        return self.target.split(".")[0]

    def describe(self) -> str:
        """``file:line module -> target`` (lazy imports marked)."""
        how = " (function-level)" if self.lazy else ""
        return f"{self.label}:{self.line} {self.module} -> {self.target}{how}"


def discover(package_dirs: dict[str, Path] | None = None) -> list[Module]:
    """Every ``.py`` file of the installed packages, named as it is imported."""
    found: dict[str, Module] = {}
    for package, folder in (package_dirs or PACKAGE_DIRS).items():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join([package, *parts])
            found[name] = Module(name, path, is_package)
    return sorted(found.values(), key=lambda m: m.name)


def stdlib_names() -> frozenset[str]:
    """Top-level names of the standard library (Python >= 3.10)."""
    return frozenset(sys.stdlib_module_names) | {"__future__"}


def imports_of(module: Module, source: str, known: Iterable[str]) -> list[Import]:
    """Every import edge of ``module`` given its ``source`` text.

    Args:
        module: the module the source belongs to (its name resolves relative imports).
        source: the Python source.
        known: dotted names of the modules that exist, to tell ``from pkg import submodule``
            from ``from pkg import name``.
    """
    visitor = _ImportVisitor(module, frozenset(known))
    visitor.visit(ast.parse(source, filename=module.label))
    return list(dict.fromkeys(visitor.found))  # one edge per (line, target), in order


def graph(modules: list[Module] | None = None) -> list[Import]:
    """The import edges of every discovered module (the real tree by default)."""
    modules = discover() if modules is None else modules
    known = {m.name for m in modules}
    edges: list[Import] = []
    for module in modules:
        edges.extend(imports_of(module, module.path.read_text(encoding="utf-8"), known))
    return edges


def resolve_relative(module: Module, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` inside ``module``.

    Raises:
        ValueError: the relative import climbs above the top-level package.
    """
    parts = module.name.split(".")
    if not module.is_package:
        parts.pop()
    if level - 1 >= len(parts):
        raise ValueError(f"{module.label}: relative import beyond the top-level package")
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([name] if name else []))


class _ImportVisitor(ast.NodeVisitor):
    """Collects import statements, import calls with literal names, and module-name strings."""

    def __init__(self, module: Module, known: frozenset[str]) -> None:
        self.module, self.known = module, known
        self.found: list[Import] = []
        self._depth = 0  # > 0 inside a function body

    def _add(self, node: ast.AST, target: str, lazy: bool = False) -> None:
        edge = Import(self.module.name, self.module.label, node.lineno, target, lazy or self._depth > 0)
        self.found.append(edge)

    def _function(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = resolve_relative(self.module, node.level, node.module) if node.level else node.module
        for alias in node.names:
            candidate = f"{base}.{alias.name}"
            self._add(node, candidate if candidate in self.known else base)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in _IMPORT_CALLS and node.args and isinstance(node.args[0], ast.Constant):
            if isinstance(node.args[0].value, str):
                self._add(node, node.args[0].value, lazy=True)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            match = _MODULE_STRING.match(node.value)
            if match and self._names_module(match.group(1)):
                self._add(node, match.group(1), lazy=True)

    def _names_module(self, name: str) -> bool:
        """True when ``name`` is one of our modules or lies in one of our subpackages
        (``tiercache.index``, a file name, is neither)."""
        parts = name.split(".")
        return any(".".join(parts[:n]) in self.known for n in range(2, len(parts) + 1))

