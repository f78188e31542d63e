"""libc functions the standard library does not wrap, loaded through ctypes (Linux)."""

from __future__ import annotations

import ctypes
from typing import Callable

__all__ = ["libc_function"]


def libc_function(name: str, argtypes: list) -> Callable[..., int] | None:
    """libc's ``name`` with its argument types and an int result, or None where libc lacks it.

    It is called without the GIL and sets ``ctypes.get_errno()`` on failure (``use_errno``).
    """
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function
