"""tiercache: a tiered (HBM / DRAM / NVMe) KV-cache manager for long-context LLM inference.

Importing ``tiercache`` loads no torch: the metadata plane (``tiercache.core``,
``tiercache.policies``, ``tiercache.sim``, ``tiercache.config``, ``tiercache.keys``) is
plain Python and numpy. The data-plane API is exposed lazily and imports torch on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public data-plane names -> the module that defines them; imported on first attribute access.
_LAZY = {
    "TieredKVStore": "tiercache.live.store",
    "TieredKVCache": "tiercache.live.cache",
    "StepReport": "tiercache.live.cache",
    "AttentionMode": "tiercache.config",
    "BlockPool": "tiercache.data.pools",
    "NVMeStore": "tiercache.data.nvme",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tiercache' has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        from .extras import missing_extra

        message = missing_extra(exc)
        if message is None:
            raise
        raise ModuleNotFoundError(f"tiercache.{name} {message}", name=exc.name) from exc
    return getattr(module, name)
