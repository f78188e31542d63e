"""Number formatting shared by the tables and the plots, so both show the same figures."""

from __future__ import annotations

__all__ = ["integer", "ratio", "percent", "size", "seconds", "optional", "recorded", "tier"]

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_TIER_NAMES = {"hbm": "HBM", "dram": "DRAM", "nvme": "NVMe"}


def tier(name: str) -> str:
    """A tier as people write it: ``nvme`` -> ``NVMe``."""
    return _TIER_NAMES.get(name, name)


def codec_suffix(codec: str) -> str:
    """`` INT4`` after a quantised tier's capacity; nothing for ``none``."""
    return "" if codec == "none" else f" {codec.upper()}"


def integer(value: int) -> str:
    """``121877`` -> ``121,877``."""
    return f"{value:,}"


def ratio(value: float) -> str:
    """A miss or hit ratio with six decimals, enough to tell apart one miss in 10^6."""
    return f"{value:.6f}"


def percent(value: float, digits: int = 1) -> str:
    """``0.4213`` -> ``42.1%``."""
    return f"{100 * value:.{digits}f}%"


def percent_or_na(value: float | None, digits: int = 1) -> str:
    """``percent``, or ``n/a`` for None (a gap closed where there is no gap to close)."""
    return "n/a" if value is None else percent(value, digits)


def size(num_bytes: float) -> str:
    """Bytes in binary units with at most one decimal: ``1.5 GiB``, ``64 MiB``."""
    value = float(num_bytes)
    for unit in _BINARY_UNITS:
        if abs(value) < 1024 or unit == _BINARY_UNITS[-1]:
            text = f"{value:,.0f}" if unit == "B" else f"{value:,.1f}".removesuffix(".0")
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def seconds(value: float) -> str:
    """Seconds with precision suited to the magnitude: ``1,234 s``, ``12.34 s``, ``0.0453 s``."""
    if abs(value) >= 100:
        return f"{value:,.0f} s"
    if abs(value) >= 1:
        return f"{value:.2f} s"
    return f"{value:.3g} s"


def optional(value, formatter) -> str:
    """``formatter(value)``, or an en dash where the value does not apply."""
    return "–" if value is None else formatter(value)


def recorded(value, formatter) -> str:
    """``formatter(value)``, or "not recorded" where the results file did not record it.

    For counters a results file of an older schema (or a run without the layout or hardware
    they need) holds as ``None``: unlike ``optional``'s dash, it does not mean zero or
    "does not apply", only that the number is unknown.
    """
    return "not recorded" if value is None else formatter(value)
