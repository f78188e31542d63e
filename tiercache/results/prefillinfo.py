"""The model a results document's modeled prefill times were computed with.

Modeled recompute and TTFT saved (``tiercache.sim.prefill``) depend on the model's parameter
count ``P`` (``2 P`` weight FLOPs per token) and, for the attention term, its query heads ``H``
(``4 L H d`` per query-key pair; ``L`` and ``d`` are in the recorded layout). A custom
``--layout`` may give neither: the weights are then the reference model's
(``REFERENCE_PARAMS``) and attention is left out. Since this record (optional in
``hardware_profile``: a file without it reads ``None``, its model unknown) results say which::

    "prefill": {"params": 70550000000 | null, "heads": 64 | null}

``null`` params: the reference model's weights; ``null`` heads: no attention term. ``tiercache
report`` refuses to merge documents whose records differ, and words its methods text from them.
Metadata plane: no torch, no numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UserError

__all__ = ["PrefillInfo", "read_prefill_info"]


@dataclass(frozen=True)
class PrefillInfo:
    """The model's numbers the prefill times used. Invariants: ``params`` and ``heads`` are
    None (not given: reference weights, no attention) or positive integers."""

    params: int | None
    heads: int | None

    @classmethod
    def of(cls, layout: Any) -> "PrefillInfo":
        """The record of a ``KVLayout`` (read by its ``params`` and ``heads``)."""
        return cls(getattr(layout, "params", None), getattr(layout, "heads", None))

    @property
    def attention(self) -> bool:
        """The attention term was included (query heads were known)."""
        return self.heads is not None

    def to_json(self) -> dict:
        """The ``prefill`` object of ``hardware_profile``."""
        return {"params": self.params, "heads": self.heads}

    def text(self) -> str:
        """``params 7.055e+10, 64 query heads`` / ``reference params (none given), no query heads``."""
        params = "reference params (none given)" if self.params is None else f"params {self.params:.4g}"
        heads = "no query heads (no attention term)" if self.heads is None else f"{self.heads} query heads"
        return f"{params}, {heads}"


def read_prefill_info(value: Any, what: str) -> PrefillInfo | None:
    """Reads the optional ``prefill`` object (``what`` names the field in errors).

    Raises:
        UserError: not an object with ``params`` and ``heads``, each null or an integer > 0.
    """
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"params", "heads"} or not all(
            v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0) for v in value.values()):
        raise UserError(f"{what}: 'prefill' must be null or {{'params': null | integer > 0, "
                        f"'heads': null | integer > 0}}, got {value!r}")
    return PrefillInfo(value["params"], value["heads"])
