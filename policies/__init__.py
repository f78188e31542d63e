"""Policy registry: one lazy ``name -> class`` map per kind, plus ``module:Class`` names.

Adding a policy is one file in this folder and one line in the map below; the contract
tests are parametrized over the map, so a new policy is tested for free. Importing this
package imports no policy module (and never torch).
"""

from __future__ import annotations

import importlib

from tiercache.errors import UserError

from .base import NO_NEXT_USE, AdmissionPolicy, EvictionPolicy, Hints, PrefetchPolicy, PrefetchView

__all__ = [
    "EVICTION",
    "ADMISSION",
    "PolicyError",
    "get_eviction",
    "get_admission",
    "make_eviction",
    "make_admission",
    "Hints",
    "EvictionPolicy",
    "AdmissionPolicy",
    "PrefetchPolicy",
    "PrefetchView",
    "PREFETCH",
    "get_prefetch",
    "make_prefetch",
    "NO_NEXT_USE",
]

EVICTION: dict[str, str] = {
    "lru": "tiercache.policies.lru:LRU",
    "fifo": "tiercache.policies.fifo:FIFO",
    "lfu": "tiercache.policies.lfu:LFU",
    "sieve": "tiercache.policies.sieve:Sieve",
    "belady": "tiercache.policies.belady:Belady",
    "arc": "tiercache.policies.arc:ARC",
    "s3fifo": "tiercache.policies.s3fifo:S3FIFO",
    "leaf_lru": "tiercache.policies.leaf_lru:LeafLRU",
    "session": "tiercache.policies.session:Session",
    "cost": "tiercache.policies.cost_aware:CostAware",
}

ADMISSION: dict[str, str] = {
    "always": "tiercache.policies.admission_always:AlwaysAdmit",
    "second_hit": "tiercache.policies.admission_second_hit:SecondHitAdmit",
    "tinylfu": "tiercache.policies.admission_tinylfu:TinyLFUAdmit",
}

PREFETCH: dict[str, str] = {
    "none": "tiercache.policies.prefetch_none:NoPrefetch",
    "layer_ahead": "tiercache.policies.prefetch_layer_ahead:LayerAhead",
    "topk_speculative": "tiercache.policies.prefetch_topk_speculative:TopKSpeculative",
}


class PolicyError(UserError):
    """Unknown or unloadable policy name; the message lists the known names."""


def _load(name: str, table: dict[str, str], kind: str, base: type) -> type:
    """The class ``name`` maps to, checked to be a subclass of ``base``.

    Raises:
        PolicyError: unknown name, unloadable target, or a target that is not a ``base`` class.
    """
    key = name.strip()
    target = table.get(key.lower())
    if target is None and ":" in key:
        target = key
    if target is None:
        raise PolicyError(f"unknown {kind} policy {name!r}; known: {', '.join(sorted(table))} (or module:Class)")
    module_name, _, class_name = target.partition(":")
    try:
        loaded = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise PolicyError(f"cannot load {kind} policy {name!r} from {target!r}: {exc}") from None
    if not isinstance(loaded, type) or not issubclass(loaded, base):
        raise PolicyError(f"{kind} policy {name!r}: {target!r} is not a subclass of {base.__name__}")
    return loaded


def get_eviction(name: str) -> type[EvictionPolicy]:
    """Returns the eviction policy class for a registry name or ``module:Class``."""
    return _load(name, EVICTION, "eviction", EvictionPolicy)


def get_admission(name: str) -> type[AdmissionPolicy]:
    """Returns the admission policy class for a registry name or ``module:Class``."""
    return _load(name, ADMISSION, "admission", AdmissionPolicy)


def make_eviction(name: str, capacity: int) -> EvictionPolicy:
    """Instantiates an eviction policy for a tier of ``capacity`` blocks."""
    return get_eviction(name)(capacity)


def make_admission(name: str) -> AdmissionPolicy:
    """Instantiates an admission policy."""
    return get_admission(name)()


def get_prefetch(name: str) -> type[PrefetchPolicy]:
    """Returns the prefetch policy class for a registry name or ``module:Class``."""
    return _load(name, PREFETCH, "prefetch", PrefetchPolicy)


def make_prefetch(name: str | None) -> PrefetchPolicy:
    """Instantiates a prefetch policy (``None`` means ``none``)."""
    return get_prefetch(name or "none")()
