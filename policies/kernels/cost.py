"""Kernel of ``tiercache.policies.cost_aware.CostAware``: GreedyDual-Size-Frequency over prefix-tree leaves.

One leaf cache (``leafprio``) per tier keyed ``L + uses x (1 + depth / depth_scale)``, the
default ``depth_scale`` of the class (the registry builds it with its defaults). The hooks are
``leaf_lru``'s: the key rule is the leaf cache's ``MODE``, set here.
"""

from __future__ import annotations

from ..cost_aware import DEFAULT_DEPTH_SCALE
from . import as_int, leafprio, njit
# The hooks and the state layout of this kernel are leaf_lru's.
from .leaf_lru import BATCH_INSERT_SAFE, FIELDS, G_ROWS, SIZE, X_EXTRA, on_access, on_insert, on_remove, victims  # noqa: F401

CODE = 8


@njit
def init(P, M, X, t, capacity):
    leafprio.init_row(P, M, X, t, t, as_int(0), leafprio.MODE_COST, capacity)
    X[t, P.shape[1] + leafprio.DSCALE] = DEFAULT_DEPTH_SCALE
