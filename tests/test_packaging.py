"""The package list in pyproject.toml names every package of the source tree.

An ordinary (non-editable) install, ``pip install .`` or a wheel, ships only the packages
``[tool.setuptools] packages`` lists: one left out (``tiercache.policies.kernels``,
``tiercache.integrations``) made every replay fail on import, while the editable install the
README uses hid it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")

ROOT = Path(__file__).resolve().parent.parent


def source_packages() -> set[str]:
    """Every folder holding an ``__init__.py``, by the name it installs under."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {"tiercache": ROOT / "tiercache", **{name: ROOT / folder for name, folder in config["package-dir"].items()}}
    found = set()
    for name, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder).parts
            if "__pycache__" not in relative:
                found.add(".".join((name, *relative)))
    return found


def test_every_source_package_is_listed_for_installation():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert source_packages() - listed == set(), "packages an ordinary install would leave out"
    assert listed - source_packages() == set(), "listed packages that do not exist"
