"""Compiled kernels of the built-in eviction policies, over numpy array state.

Each kernel module mirrors one policy class of ``tiercache.policies`` call for call: the
same ``on_insert / on_access / on_remove / victims`` hooks, over a dense index per block id
(``0 .. n_ids - 1``) instead of Python dicts, so that a replay can hand a whole request to
compiled code. The Python classes stay the reference (and the only path for out-of-tree
policies); ``tests/test_kernels.py`` replays every registered policy both ways and compares
the per-tier counts exactly.

State layout, shared by every kernel so that one compiled hierarchy chain
(``tiercache.sim.chain``) can drive any of them:

* ``P``: int64 ``[tiers, L, FIELDS + 1]``: per-id fields (links, flags, counts), scratch
  columns, and last the victims column (``victims(n)`` writes its answer to ``P[t, :n, -1]``);
  ``L >= n_ids`` (LFU also needs ``L >= max count + 2`` for its frequency buckets). An id's
  fields are adjacent (one cache line), since list and heap walks touch several per node.
* ``M``: int64 ``[tiers + 1, W]``: columns ``0 .. META_SLOTS - 1`` of row ``t`` are the
  kernel's list heads, tails, sizes and parameters (the chain keeps its counters after them).
* ``X``: float64 ``[tiers, 1]``: real-valued state (ARC's target ``p``); a kernel with
  ``X_EXTRA`` gets ``[rows, L + X_EXTRA]`` (a real key per id, then its parameters).
* ``G``: int64 ``[G_ROWS, L]``: per-id state shared by the tiers (``TIER_OF``, ``PROT``, ...);
  a kernel may ask for more rows (its own ``G_ROWS``: scratch).

A kernel may keep more rows of ``P`` and ``X`` than one per tier (``EXTRA_ROWS``, after
them: ``session``'s shadow caches); tier ``t``'s own row is always ``t``.

Few arrays on purpose: every array argument of a compiled call is a dozen machine words, and
a replay makes several such calls per miss.

Every kernel module defines ``CODE`` (its number in the chain's dispatch), ``BATCH_INSERT_SAFE``
(as the class's ``batch_insert_safe``), ``init(P, M, X, t, capacity)`` and the four hooks.
``KERNELS`` (in ``tiercache.policies``) links a registry name to its kernel module.

numba compiles them (``cache=True``: compiled once per machine, into ``__pycache__``, else
``$HOME/.cache/numba`` or ``NUMBA_CACHE_DIR``). Where numba finds none of those writable (a
read-only install with no writable home) they compile without the on-disk cache, anew in each
process, after one ``NO_DISK_CACHE`` warning. Without numba (not installed, or
``TIERCACHE_NO_NUMBA=1``) ``HAVE_NUMBA`` is False, the decorators leave plain Python
functions, and replays take the Python manager with the reference classes instead (correct,
and as fast as before).
"""

from __future__ import annotations

import functools
import os
import warnings

__all__ = ["HAVE_NUMBA", "njit", "njit_inline", "as_int", "NIL", "numba_disabled", "NO_DISK_CACHE", "TIER_OF", "PROT", "STAMP", "FUT", "HINT", "G_ROWS",
           "META_SLOTS", "S_PARENTS", "S_REQ"]

#: "No node" in every link field and list head.
NIL = -1
#: Rows of ``G``, the per-id state every tier shares: the tier holding the id (-1: none),
#: protection from eviction (the segment being promoted), scratch marks, next use as last
#: seen (the manager's ``_future``, which a demoted block carries), and the next use a hook
#: call passes (``Hints.next_use``: the access's own for trace ids, ``FUT`` for demotions).
TIER_OF, PROT, STAMP, FUT, HINT = 0, 1, 2, 3, 4
G_ROWS = 5
#: Columns of ``M`` a kernel may use for its own meta state (the chain's counters follow;
#: ``session`` keeps its shadows' meta here too).
META_SLOTS = 72
#: Columns of ``M``'s last row the chain sets for the hooks that read parents (the prefix-tree
#: kernels): ``S_PARENTS`` is 1 while hook calls get trace ids, whose parent is the id before
#: (from ``S_REQ``, the position where the request starts), and 0 for blocks moved between
#: tiers, which get no parents (as the manager's demotions).
S_PARENTS, S_REQ = 5, 6


def numba_disabled() -> bool:
    """True when ``TIERCACHE_NO_NUMBA`` asks for the pure-Python path (tests force it)."""
    return os.environ.get("TIERCACHE_NO_NUMBA", "") not in ("", "0")


#: The compiled replay's modules outside ``policies/`` (``policies/**/*.py`` are all stamped:
#: kernels read constants of their Python classes, ``session.py``, ``cost_aware.py``, ``base.py``).
#: numba freezes what a compiled function inlines (``dispatch.py``'s functions) and the module
#: constants it reads (``traces.MAX_TOKENS``) into its cache: they are stamped with it.
#: ``tests/test_kernel_cache_stamp.py`` checks that every module a compiled module imports is here
#: (``fastscan`` reads ``tracelines.MAX_LINE_BYTES`` through the package: ``__init__`` too).
STAMPED_SIM_MODULES = ("chain", "dispatch", "prep", "fastscan", "traces", "tracelines", "__init__", "stackdist")


def stamped_sources() -> list:
    """The source files whose edit must drop the compiled caches: every ``.py`` under
    ``policies/`` and ``STAMPED_SIM_MODULES`` of ``tiercache/sim``, sorted."""
    from pathlib import Path

    import tiercache  # the package root (already imported: this module is inside it)

    root = Path(__file__).resolve().parents[1]
    # Beside ``policies/`` in the checkout, around it in an install: ask the package where it is.
    sim = Path(tiercache.__file__).resolve().parent / "sim"
    return sorted(root.rglob("*.py")) + [sim / f"{name}.py" for name in STAMPED_SIM_MODULES]


def _drop_stale_caches() -> None:
    """Deletes numba's cache files of the kernels and the chain when any of their sources changed.

    numba keys a cached function on its own file only: after an edit of a kernel, the chain
    (``tiercache/sim/chain.py``, which inlines the kernels through ``dispatch.py``) would load
    stale machine code, and so would a kernel after an edit of a constant it reads from
    another module. A stamp of all their sources (``stamped_sources``), kept beside the
    caches, catches that; only our own cache files are removed.
    """
    import hashlib
    from pathlib import Path

    sources = stamped_sources()
    here = Path(__file__).resolve().parent
    try:
        digest = hashlib.blake2b(digest_size=16)
        for source in sources:  # name and length first: moving code between files changes it too
            data = source.read_bytes() if source.exists() else b""
            digest.update(f"{source.name}:{len(data)}:".encode())
            digest.update(data)
        digest = digest.hexdigest()
        stamp = here / "__pycache__" / "kernels.stamp"
        if stamp.exists() and stamp.read_text() == digest:
            return
        for folder in {p.parent / "__pycache__" for p in sources}:
            for cached in list(folder.glob("*.nbi")) + list(folder.glob("*.nbc")):
                cached.unlink(missing_ok=True)
        stamp.parent.mkdir(exist_ok=True)
        stamp.write_text(digest)
    except OSError:
        pass  # a read-only install: nothing was compiled there to go stale


#: The one warning when numba can keep no compiled code on disk (then every process compiles).
NO_DISK_CACHE = ("tiercache: numba has no writable cache folder (__pycache__, ~/.cache/numba or NUMBA_CACHE_DIR): "
                 "kernels compile without the on-disk cache, on every start")


@functools.lru_cache(maxsize=None)
def _warn_no_disk_cache() -> None:
    """Warns once per process (lru_cache) that the kernels compile without the on-disk cache."""
    warnings.warn(NO_DISK_CACHE, RuntimeWarning, stacklevel=2)


try:
    if numba_disabled():
        raise ImportError("TIERCACHE_NO_NUMBA is set")
    import numba

    HAVE_NUMBA = True
    _drop_stale_caches()

    def _jit(func, **options):
        """numba's ``njit`` of ``func`` with the on-disk cache, or without it (compiled anew in
        each process, after one ``NO_DISK_CACHE`` warning) where numba has nowhere to keep it."""
        # No reference counting: the kernels allocate nothing, and counting the array
        # arguments of every internal call cost ~70 ns per call (a replay makes several per miss).
        try:
            return numba.njit(cache=True, nogil=True, _nrt=False, **options)(func)
        except RuntimeError:  # numba: "cannot cache function ...: no locator available for file ..."
            _warn_no_disk_cache()
            return numba.njit(nogil=True, _nrt=False, **options)(func)

    def njit(func):
        """numba's ``njit`` with the on-disk cache (compile once per machine)."""
        return _jit(func)

    def njit_inline(func):
        """``njit`` inlined into its callers at numba's IR level (small dispatch functions
        called several times per miss: a call with these array arguments costs ~10 ns)."""
        return _jit(func, inline="always")

    @njit_inline
    def as_int(x):
        """``x`` as a plain int64: a constant passed straight to a kernel function would make
        numba compile one more copy of it, and of all it calls, per constant value."""
        return numba.int64(x)

except ImportError:
    HAVE_NUMBA = False

    def as_int(x):
        """Without numba: ``x`` itself."""
        return x

    def njit(func):
        """Without numba the kernels stay plain Python (used only by tests of the logic)."""
        return func

    njit_inline = njit
