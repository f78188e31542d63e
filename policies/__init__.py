"""Policy registry: one lazy ``name -> class`` map per kind, plus ``module:Class`` names.

Adding a policy is one file in this folder and one line in the map below; the contract
tests are parametrized over the map, so a new policy is tested for free. Importing this
package imports no policy module (and never torch).
"""

from __future__ import annotations

import importlib

from tiercache.errors import UserError

from .base import NO_NEXT_USE, AdmissionPolicy, EvictionPolicy, Hints, PlacementPolicy, PrefetchPolicy, PrefetchView, in_tree

__all__ = [
    "EVICTION",
    "ADMISSION",
    "PolicyError",
    "canonical_name",
    "in_tree",
    "get_eviction",
    "get_admission",
    "make_eviction",
    "make_admission",
    "Hints",
    "EvictionPolicy",
    "AdmissionPolicy",
    "PlacementPolicy",
    "PLACEMENT",
    "get_placement",
    "make_placement",
    "PrefetchPolicy",
    "PrefetchView",
    "PREFETCH",
    "get_prefetch",
    "make_prefetch",
    "NO_NEXT_USE",
    "KERNELS",
    "get_kernel",
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

#: Eviction policies with a compiled kernel (``policies/kernels/``, one module per policy,
#: mirroring the class call for call); replays use it when numba is available.
KERNELS: dict[str, str] = {
    "lru": "tiercache.policies.kernels.lru",
    "fifo": "tiercache.policies.kernels.fifo",
    "lfu": "tiercache.policies.kernels.lfu",
    "sieve": "tiercache.policies.kernels.sieve",
    "belady": "tiercache.policies.kernels.belady",
    "arc": "tiercache.policies.kernels.arc",
    "s3fifo": "tiercache.policies.kernels.s3fifo",
    "leaf_lru": "tiercache.policies.kernels.leaf_lru",
    "cost": "tiercache.policies.kernels.cost",
    "session": "tiercache.policies.kernels.session",
}

ADMISSION: dict[str, str] = {
    "always": "tiercache.policies.admission_always:AlwaysAdmit",
    "second_hit": "tiercache.policies.admission_second_hit:SecondHitAdmit",
    "tinylfu": "tiercache.policies.admission_tinylfu:TinyLFUAdmit",
}

#: Where blocks go in an exclusive hierarchy (new blocks, hits below the top).
PLACEMENT: dict[str, str] = {
    "top": "tiercache.policies.placement_top:TopPlacement",
    "reuse": "tiercache.policies.placement_reuse:ReusePlacement",
}

PREFETCH: dict[str, str] = {
    "none": "tiercache.policies.prefetch_none:NoPrefetch",
    "layer_ahead": "tiercache.policies.prefetch_layer_ahead:LayerAhead",
    "topk_speculative": "tiercache.policies.prefetch_topk_speculative:TopKSpeculative",
}


#: The methods each kind's base class leaves to its policies (the base raises
#: NotImplementedError): a ``module:Class`` that does not define them all is refused.
_REQUIRED: dict[type, tuple[str, ...]] = {
    EvictionPolicy: ("on_insert", "on_access", "on_remove", "victims", "__len__", "__contains__"),
    AdmissionPolicy: ("admit",),
    PlacementPolicy: ("insert_tier", "promote_tier"),
    PrefetchPolicy: ("plan",),
}


class PolicyError(UserError):
    """Unknown or unloadable policy name; the message lists the known names."""


def canonical_name(name: str, table: dict[str, str]) -> str:
    """The name a run records for policy ``name`` of ``table`` (``EVICTION``, ``ADMISSION``...).

    A registered name is matched case-insensitively and given as registered (``" LRU"`` ->
    ``"lru"``); anything else (a ``module:Class``) is returned stripped. The name is not
    loaded: ``get_eviction`` and its siblings check it.
    """
    key = name.strip()
    return key.lower() if key.lower() in table else key


def _path_hint(exc: BaseException, module_name: str) -> str:
    """For a policy module that is nowhere on ``sys.path``: where Python looked for it (the
    ``tiercache`` console script's path starts at its own bin folder, not the current one)."""
    if not isinstance(exc, ModuleNotFoundError) or exc.name != module_name.partition(".")[0]:
        return ""
    return ("; Python imports it from sys.path, which the tiercache command does not start at the current folder: "
            "install its package, set PYTHONPATH to the folder holding it, or run python -m tiercache")


def _load(name: str, table: dict[str, str], kind: str, base: type) -> type:
    """The class ``name`` maps to, checked to be a concrete subclass of ``base``.

    Raises:
        PolicyError: unknown name, a relative or unloadable target (whatever its module
            raises on import), or a target that is not a subclass of ``base`` or leaves one
            of ``base``'s methods unimplemented (``base`` itself, for instance), or a name
            that is not a string.
    """
    if not isinstance(name, str):
        raise PolicyError(f"{kind} policy must be a name (a str), got {type(name).__name__} {name!r}; "
                          f"known: {', '.join(sorted(table))} (or module:Class)")
    key = name.strip()
    target = table.get(key.lower())
    if target is None and ":" in key:
        target = key
    if target is None:
        raise PolicyError(f"unknown {kind} policy {name!r}; known: {', '.join(sorted(table))} (or module:Class)")
    module_name, _, class_name = target.partition(":")
    if not module_name or module_name.startswith(".") or not class_name:
        raise PolicyError(f"{kind} policy {name!r}: give an absolute module:Class, e.g. mypackage.mymodule:MyPolicy")
    try:
        loaded = getattr(importlib.import_module(module_name), class_name)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the module is the user's: whatever its import raises is reported (a script's sys.exit too)
        source = "" if target == key else f" from {target!r}"  # a registered name: the module it maps to
        raise PolicyError(f"cannot load {kind} policy {name!r}{source}: {type(exc).__name__}: {exc}"
                          f"{_path_hint(exc, module_name)}") from None
    if not isinstance(loaded, type) or not issubclass(loaded, base):
        raise PolicyError(f"{kind} policy {name!r}: {target!r} is not a subclass of {base.__name__}")
    missing = [method for method in _REQUIRED[base] if getattr(loaded, method) is getattr(base, method)]
    if missing:
        raise PolicyError(f"{kind} policy {name!r}: {target!r} does not implement {', '.join(missing)} "
                          f"(an abstract {base.__name__})")
    return loaded


def get_eviction(name: str) -> type[EvictionPolicy]:
    """Returns the eviction policy class for a registry name or ``module:Class``."""
    return _load(name, EVICTION, "eviction", EvictionPolicy)


def get_kernel(name: str):
    """The kernel module of a registered eviction policy, or None (no kernel: out-of-tree
    policies). Imports the module (and numba, when installed)."""
    target = KERNELS.get(name.strip().lower())
    return None if target is None else importlib.import_module(target)


def get_admission(name: str) -> type[AdmissionPolicy]:
    """Returns the admission policy class for a registry name or ``module:Class``."""
    return _load(name, ADMISSION, "admission", AdmissionPolicy)


def make_eviction(name: str, capacity: int, tier: int = 0) -> EvictionPolicy:
    """Instantiates an eviction policy for tier ``tier`` (0: the top) of ``capacity`` blocks
    (``EvictionPolicy.for_tier``).

    Invariant: the answer is an ``EvictionPolicy`` (an out-of-tree ``for_tier`` may answer
    anything; it is checked here, where the hook is known, not when the manager first uses it).

    Raises:
        ValueError: ``for_tier`` answered something else, naming the policy, the call and the
            answer's type (a replay reports it in one line with the run, as other contract
            breaks: ``tiercache.core.answers``).
    """
    policy = get_eviction(name).for_tier(capacity, tier)
    if not isinstance(policy, EvictionPolicy):
        raise ValueError(f"eviction policy {canonical_name(name, EVICTION)}: for_tier({capacity}, {tier}) answered an object "
                         f"of type {type(policy).__name__}, not an EvictionPolicy")
    return policy


def make_admission(name: str) -> AdmissionPolicy:
    """Instantiates an admission policy."""
    return get_admission(name)()


def get_placement(name: str) -> type[PlacementPolicy]:
    """Returns the placement policy class for a registry name or ``module:Class``."""
    return _load(name, PLACEMENT, "placement", PlacementPolicy)


def make_placement(name: str, n_tiers: int) -> PlacementPolicy:
    """Instantiates a placement policy for a hierarchy of ``n_tiers`` tiers."""
    return get_placement(name)(n_tiers)


def get_prefetch(name: str) -> type[PrefetchPolicy]:
    """Returns the prefetch policy class for a registry name or ``module:Class``."""
    return _load(name, PREFETCH, "prefetch", PrefetchPolicy)


def make_prefetch(name: str | None) -> PrefetchPolicy:
    """Instantiates a prefetch policy (``None`` means ``none``)."""
    return get_prefetch(name or "none")()
