"""The optional packages tiercache's extras bring, and the message a missing one gets.

The metadata plane (replay, compare, report, trace) needs none of them; the data plane needs
torch, the drop-in cache transformers, the shared tier Mooncake Store. A user who installed
``tiercache`` without the extra is told which one to install, by name, not shown a traceback.
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRAS", "installed", "install_hint", "missing_extra", "require"]

#: Top-level module -> the extra of ``pyproject.toml`` that installs it.
EXTRAS = {"torch": "cpu", "transformers": "hf", "mooncake": "remote", "cupy": "gpu", "libcachesim": "test"}


def install_hint(module: str) -> str:
    """How to install ``module``'s extra (torch: the CPU pin, or the machine's own CUDA build)."""
    extra = EXTRAS[module]
    hint = f"pip install 'tiercache[{extra}]'"
    if module == "torch":
        hint += " (or the machine's own CUDA build of torch)"
    if module == "mooncake":
        hint += " and the Debian packages libibverbs1 libnuma1"
    return hint


def installed(module: str) -> bool:
    """Whether top-level ``module`` can be imported here (found on ``sys.path``)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken entry in sys.modules
        return False


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The sentence for ``exc`` when the missing module is one an extra brings and is not
    installed, else None: an installed package that lacks a submodule (another version than
    tiercache's) is not "not installed", and its traceback says which module."""
    root = (exc.name or "").split(".")[0]
    if root not in EXTRAS or installed(root):
        return None
    return _needs(root)


def _needs(module: str) -> str:
    """The sentence every refusal for a missing ``module`` says."""
    return f"needs {module}, which is not installed here: {install_hint(module)}"


def require(*modules: str, what: str) -> None:
    """Raises ModuleNotFoundError naming the extra for the first of ``modules`` not installed.

    Args:
        modules: top-level module names, keys of ``EXTRAS``.
        what: the feature that needs them, as the message starts.
    """
    for module in modules:
        if not installed(module):
            raise ModuleNotFoundError(f"{what} {_needs(module)}", name=module)
