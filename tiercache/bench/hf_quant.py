"""What users have today: ``transformers``' quantised KV cache layers on the same KV.

``transformers`` is not a tiercache dependency (``pip install 'tiercache[hf]'`` brings it; its
quantised caches need a backend too: ``optimum-quanto`` or ``hqq``). Where it is installed,
``compare`` puts the benchmark's K and V through every quantised cache layer class transformers
ships (``Fp8QuantizedLayer``: e4m3, one scale per tensor; ``QuantoQuantizedLayer``,
``HQQQuantizedLayer``: 8 and 4 bits where the backend takes them, groups of 64, along the
axis transformers' docs recommend) with the layer's own ``update`` and reads them back
dequantised, returning the round-trip errors (the caller adds attention error);
everything it could not run is named in ``note``, never raised.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["compare"]

_GROUP = 64
_BITS = (8, 4)
#: The axes transformers' docs recommend per backend (quanto: 0, HQQ: 1).
_AXIS = {"QuantoQuantizedLayer": 0, "HQQQuantizedLayer": 1}


def compare(k: torch.Tensor, v: torch.Tensor) -> dict:
    """``{"note": str, "layers": [...]}``: per layer class and bit width, ``name``,
    ``bits``, nominal ``bytes_ratio`` vs fp16 (codes, plus an fp16 scale and zero point per
    group of 64 where grouped), ``k_rel_err``, ``v_rel_err`` and the dequantised
    ``k_hat``/``v_hat``.

    ``k`` and ``v`` are ``[layers, heads, tokens, head_dim]``; each layer index is one
    batch row for transformers.
    """
    try:
        from transformers import cache_utils
    except ImportError as exc:
        why = "is not installed" if getattr(exc, "name", "") == "transformers" else f"does not import ({exc})"
        return {"note": f"transformers {why}: comparison skipped (not a tiercache dependency; "
                        "pip install 'tiercache[hf]' plus optimum-quanto or hqq to run it)", "layers": []}
    classes = {name: getattr(cache_utils, name) for name in dir(cache_utils)
               if name.endswith("QuantizedLayer") and not inspect.isabstract(getattr(cache_utils, name))
               and name != "QuantizedLayer"}
    if not classes:
        return {"note": "this transformers has no quantised cache layer classes (older than 4.54?): comparison skipped",
                "layers": []}
    layers, problems = [], []
    for name, cls in sorted(classes.items()):
        takes_bits = "nbits" in inspect.signature(cls.__init__).parameters
        for bits in (_BITS if takes_bits else (None,)):
            try:
                layers.append(_round_trip(name, cls, bits, k, v))
            except Exception as exc:  # a missing backend, an unsupported bit width: report, never fail the bench
                problems.append(f"{name} {bits or 8}-bit: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return {"note": "; ".join(problems), "layers": layers}


def _round_trip(name: str, cls: type, bits: int | None, k: torch.Tensor, v: torch.Tensor) -> dict:
    """One layer class (at one bit width when it takes one): the whole KV goes in through the
    layer's own ``update``, as a prefill would, and is read back dequantised."""
    if bits is None:  # Fp8QuantizedLayer: e4m3 with one scale per tensor
        layer, nominal = cls(), 0.5
    else:
        axis = _AXIS.get(name, 0)
        layer = cls(nbits=bits, axis_key=axis, axis_value=axis, q_group_size=_GROUP, residual_length=0)
        nominal = (bits / 8 + 4 / _GROUP) / 2  # codes plus an fp16 scale and zero point per group
    layer.update(k, v)
    k_hat = layer._dequantize(layer._quantized_keys).to(torch.float32)
    v_hat = layer._dequantize(layer._quantized_values).to(torch.float32)
    return {"name": name, "bits": bits or 8, "bytes_ratio": nominal,
            "k_rel_err": _rel(k_hat, k), "v_rel_err": _rel(v_hat, v), "k_hat": k_hat, "v_hat": v_hat}


def _rel(approx: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.double()
    return float((approx.double() - exact).norm() / exact.norm())
