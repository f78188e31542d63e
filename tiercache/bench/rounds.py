"""Side-by-side timing in rounds: every operation once per round, the one that goes first
rotating, so that entry ``i`` of two operations was measured right next to each other and a
ratio of neighbours cancels the machine's regime switches (a shared VM's copy can run 50x
slower for a while; a ratio of medians taken at different moments would not cancel that).

Used by the scripts that compare against a baseline (``scripts/bench_quant.py``,
``scripts/disagg_demo.py``), and ``Tally`` by ``tiercache bench``; pure Python, no torch.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable, TypeVar

__all__ = ["Tally", "alternate", "paired_ratio", "positive_int"]

T = TypeVar("T")


def alternate(ops: dict[str, Callable[[int], T]], rounds: int) -> dict[str, list[T]]:
    """Runs every op once untimed as ``op(0)`` (warm-up: first calls pay one-time costs), then
    rounds ``1 .. rounds``, each calling every op once as ``op(i)``; round ``i`` starts at op
    ``(i - 1) % len(ops)`` (in ``ops`` order) and goes round. Each op measures itself and
    returns its result (seconds, or a record).

    Returns:
        Each op's results of rounds ``1 .. rounds`` in round order (the warm-up left out).

    Raises:
        ValueError: ``rounds`` below 1.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    for op in ops.values():
        op(0)
    names, results = list(ops), {name: [] for name in ops}
    for i in range(1, rounds + 1):
        first = (i - 1) % len(names)
        for name in names[first:] + names[:first]:
            results[name].append(ops[name](i))
    return results


class Tally:
    """Time and bytes per side over the rounds of one comparison, and every round's ratio
    of ``"tiercache"`` throughput to each other side's (measured right next to each other).

    Invariant: ``ratios[side]`` has one entry per ``add``, for every side but ``"tiercache"``.
    """

    def __init__(self, sides: tuple[str, ...]) -> None:
        self.sides = sides
        self.seconds = dict.fromkeys(sides, 0.0)
        self.nbytes = dict.fromkeys(sides, 0)
        self.ratios: dict[str, list[float]] = {side: [] for side in sides if side != "tiercache"}

    def add(self, seconds: dict[str, float], nbytes: dict[str, int]) -> None:
        """Adds one round: each side's seconds and bytes."""
        for side in self.sides:
            self.seconds[side] += seconds[side]
            self.nbytes[side] += nbytes[side]
        mine = nbytes["tiercache"] / seconds["tiercache"]
        for side, ratios in self.ratios.items():
            ratios.append(mine / (nbytes[side] / seconds[side]))

    def gbps(self, side: str) -> float:
        """``side``'s throughput over all rounds, GB/s (1e9 bytes per second)."""
        return self.nbytes[side] / self.seconds[side] / 1e9

    def median_ratio(self, side: str) -> float:
        """The median over rounds of tiercache's throughput over ``side``'s."""
        return float(statistics.median(self.ratios[side]))


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of ``numerator[i] / denominator[i]`` (two ops' seconds in the same
    round of ``alternate``): the ratio of neighbours. The lists must be of equal length."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def positive_int(text: str) -> int:
    """argparse type of a count of rounds or blocks: an integer >= 1 (argparse names the option
    and exits 2 otherwise)."""
    return checked_int(text, 1, None, "a positive integer")


def checked_int(text: str, low: int, high: int | None, expected: str, in_range: str | None = None) -> int:
    """``text`` as an integer in ``[low, high]`` (no upper bound for None), for argparse types.

    Raises:
        argparse.ArgumentTypeError: "expected {expected}" (not an integer) or "expected
            {in_range}" (out of range; ``expected`` again when None), with what was given.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"expected {in_range or expected}, got {value}")
    return value
