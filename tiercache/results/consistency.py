"""Checks a results file's run against figures that only a damaged or hand-edited file could
hold, beyond the counts each record checks itself (``records``): the reader refuses such a
file naming the figure, rather than a report rendering it (probe Q80-4/6).

Records made by a replay never fail these; they are not checked when a record is built, so a
replay never stops on one.
"""

from __future__ import annotations

import math
from typing import Mapping

from .records import RunRecord

__all__ = ["check_run_figures"]

#: How far a recorded ``total`` may lie from the sum of its parts, per figure: each is rounded
#: to 6 decimals on its own.
_TOTAL_SLACK_S = 1e-5


def check_run_figures(run: RunRecord) -> None:
    """Modeled seconds (the run's and each instance's) finite, not negative, with a ``total``
    that is the sum of the rest; prefill tokens saved at most the prefill tokens; a fleet's
    instances record TTFT saved exactly when the run does.

    Raises:
        ValueError: naming the figure (and the instance) and its value.
    """
    _check_seconds(run.modeled_seconds, "")
    if None not in (run.prefill_tokens, run.prefill_tokens_saved) and run.prefill_tokens_saved > run.prefill_tokens:
        raise ValueError(f"prefill_tokens_saved {run.prefill_tokens_saved} > prefill_tokens {run.prefill_tokens}")
    for instance in run.instances or ():
        where = f"instance {instance.instance}: "
        _check_seconds(instance.modeled_seconds, where)
        if (instance.ttft_saved_s is None) != (run.ttft_saved_s is None):
            raise ValueError(f"{where}ttft_saved_s {instance.ttft_saved_s!r} beside the run's {run.ttft_saved_s!r} "
                             "(recorded for both, with hardware, or for neither)")


def _check_seconds(seconds: Mapping[str, float], where: str) -> None:
    """Raises ValueError unless every figure is finite and not negative, and a ``total`` is
    the sum of the others."""
    for name, value in seconds.items():
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}modeled_seconds {name!r} is {value!r}; modeled seconds are finite and not negative")
    if "total" in seconds:
        parts = math.fsum(v for k, v in seconds.items() if k != "total")
        if abs(seconds["total"] - parts) > _TOTAL_SLACK_S * len(seconds) + 1e-9 * parts:
            raise ValueError(f"{where}modeled_seconds total {seconds['total']!r} is not the sum of its parts ({parts!r})")
