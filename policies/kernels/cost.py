"""Kernel of ``tiercache.policies.cost_aware.CostAware``: GreedyDual-Size-Frequency over prefix-tree leaves.

One leaf cache (``leafprio``) per tier keyed ``L + uses x (1 + depth / depth_scale)``, the
default ``depth_scale`` of the class (the registry builds it with its defaults). The hooks are
``leaf_lru``'s: the key rule is the leaf cache's ``MODE``, set here.
"""

from __future__ import annotations

from ..cost_aware import DEFAULT_DEPTH_SCALE
from . import as_int, leafprio, njit
from .leaf_lru import on_access, on_insert, on_remove, victims  # noqa: F401  (the hooks of this kernel)

CODE = 8
BATCH_INSERT_SAFE = False
FIELDS = leafprio.FIELDS
X_EXTRA = leafprio.X_EXTRA
G_ROWS = leafprio.G_ROWS
SIZE = leafprio.SIZE


@njit
def init(P, M, X, t, capacity):
    leafprio.init_row(P, M, X, t, t, as_int(0), leafprio.MODE_COST, capacity)
    X[t, P.shape[1] + leafprio.DSCALE] = DEFAULT_DEPTH_SCALE
