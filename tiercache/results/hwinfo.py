"""The hardware profile a results document was modeled under: its numbers, not its name alone.

``results.json`` names the profile in ``hardware`` (a preset's name, a profile JSON's free-text
``name``, ``+network`` for a fleet's shared tier). Since results schema 8 (optional: a file
without it reads it as ``None``) it also records ``hardware_profile``: the machine's own
(local) links and prefill speed, and apart from them the network of a fleet's shared tier::

    {"name": "h200-pcie5-nvme4", "links": {"dram->hbm": {"bandwidth_Bps": 5.5e10, "latency_s": 1e-5}, ...},
     "prefill_tokens_per_s": 28000.0, "network": null | {"name": "tcp-25g", "links": {...}},
     "prefill_model": "flops-attention/1", "prefill": {"params": ..., "heads": ...}, "digest": "xxh3-64:..."}

``prefill`` (optional, ``tiercache.results.prefillinfo``) is the model's parameter count and
query heads the prefill times used, null where the layout gave none.

``digest`` is xxh3-64 of the canonical JSON (sorted keys) of the local links and prefill
speed (and the prefill model and ``prefill`` where recorded): two documents modeled on the
same machine, with the same model, have the same digest whatever the profile was called. ``tiercache report`` compares these numbers (``HardwareInfo.local``), and treats
the network as a fleet run's own attribute. Metadata plane: no torch, no numpy.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import xxhash

from ..errors import UserError
from .prefillinfo import PrefillInfo, read_prefill_info

__all__ = ["HardwareInfo", "NetworkInfo", "NETWORK_LINK_NAMES", "PREFILL_MODEL", "LEGACY_PREFILL_MODEL",
           "read_hardware_info"]

#: The prefill cost model modeled times are computed under (``tiercache.sim.prefill``: weight
#: and causal-attention FLOPs). Recorded in ``hardware_profile``; documents whose models differ
#: do not compare.
PREFILL_MODEL = "flops-attention/1"
#: What a ``hardware_profile`` without ``prefill_model`` was computed under: a flat per-token rate.
LEGACY_PREFILL_MODEL = "flat-per-token"

#: Links that belong to a shared remote tier's network, not to the machine itself.
NETWORK_LINK_NAMES = ("remote->dram", "dram->remote", "remote->hbm", "hbm->remote")

#: One link's numbers: (bandwidth in B/s, latency in s).
LinkNumbers = tuple[float, float]


@dataclass(frozen=True)
class NetworkInfo:
    """The network of a fleet's shared tier. Invariant: ``links`` holds network links only."""

    name: str
    links: Mapping[str, LinkNumbers]

    def to_json(self) -> dict:
        """The ``network`` object of ``hardware_profile``."""
        return {"name": self.name, "links": _links_json(self.links)}


@dataclass(frozen=True)
class HardwareInfo:
    """The recorded numbers of a hardware profile.

    Invariants: ``links`` holds the machine's links only (no ``NETWORK_LINK_NAMES``), each
    ``(bandwidth_Bps > 0, latency_s >= 0)``, finite; ``network`` is None for a replay without
    a shared tier's links. ``name`` is the machine's (local) name, without ``+network``.
    """

    name: str
    links: Mapping[str, LinkNumbers]
    prefill_tokens_per_s: float | None
    network: NetworkInfo | None = None
    prefill_model: str = PREFILL_MODEL
    #: The model's numbers the prefill times used (``prefillinfo``); None in files written
    #: before it was recorded, or for a document without a layout.
    prefill: PrefillInfo | None = None

    @property
    def local(self) -> tuple:
        """What two documents must share to compare modeled times: links, prefill speed and
        the prefill cost model."""
        return (tuple(sorted(self.links.items())), self.prefill_tokens_per_s, self.prefill_model)

    @property
    def digest(self) -> str:
        """``xxh3-64:`` and the hex digest of the canonical JSON of the local numbers and the
        prefill model (left out where it is the legacy one, as such files were written)."""
        numbers = {"links": _links_json(self.links), "prefill_tokens_per_s": self.prefill_tokens_per_s}
        if self.prefill_model != LEGACY_PREFILL_MODEL:
            numbers["prefill_model"] = self.prefill_model
        if self.prefill is not None:
            numbers["prefill"] = self.prefill.to_json()
        body = json.dumps(numbers, sort_keys=True, separators=(",", ":"))
        return "xxh3-64:" + xxhash.xxh3_64_hexdigest(body.encode())

    def difference(self, other: "HardwareInfo") -> str:
        """``dram->hbm 55 GB/s, 10 us vs 25 GB/s, 10 us; prefill 28000 vs 1000 tokens/s``:
        the local numbers in which two records differ, this one's first."""
        parts = []
        for name in sorted(set(self.links) | set(other.links)):
            mine, theirs = self.links.get(name), other.links.get(name)
            if mine != theirs:
                parts.append(f"{name} {_link_text(mine)} vs {_link_text(theirs)}")
        if self.prefill_tokens_per_s != other.prefill_tokens_per_s:
            parts.append(f"prefill {self.prefill_tokens_per_s:g} vs {other.prefill_tokens_per_s:g} tokens/s"
                         if None not in (self.prefill_tokens_per_s, other.prefill_tokens_per_s)
                         else f"prefill {self.prefill_tokens_per_s} vs {other.prefill_tokens_per_s} tokens/s")
        if self.prefill_model != other.prefill_model:
            parts.append(f"prefill model {self.prefill_model} vs {other.prefill_model}")
        return "; ".join(parts)

    @classmethod
    def of(cls, profile: Any, networks: Iterable[str] = (), layout: Any = None) -> "HardwareInfo":
        """The record of a ``tiercache.sim.hardware.HardwareProfile`` (read by its ``name``,
        ``links`` and ``prefill_tokens_per_s``). ``networks``: the network presets' names; a
        profile named ``machine+preset`` (``with_network``) that carries network links is
        recorded as ``machine`` with network ``preset``; a profile JSON that gives network
        links itself names its network by its own name. ``layout``: the ``KVLayout`` whose
        model the prefill times used (its ``params`` and ``heads``, recorded as ``prefill``)."""
        numbers = {n: (float(l.bandwidth_Bps), float(l.latency_s)) for n, l in profile.links.items()}
        net = {n: v for n, v in numbers.items() if n in NETWORK_LINK_NAMES}
        local = {n: v for n, v in numbers.items() if n not in NETWORK_LINK_NAMES}
        name, network = profile.name, None
        if net and "+" in name and name.rsplit("+", 1)[1] in set(networks):
            name, network = name.rsplit("+", 1)
        rate = profile.prefill_tokens_per_s
        return cls(name, local, None if rate is None else float(rate),
                   NetworkInfo(network or name, net) if net else None,
                   prefill=None if layout is None else PrefillInfo.of(layout))

    def to_json(self) -> dict:
        """The ``hardware_profile`` object of results.json."""
        return {"name": self.name, "links": _links_json(self.links), "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "network": None if self.network is None else self.network.to_json(),
                "prefill_model": self.prefill_model,
                **({} if self.prefill is None else {"prefill": self.prefill.to_json()}), "digest": self.digest}


def _links_json(links: Mapping[str, LinkNumbers]) -> dict:
    return {n: {"bandwidth_Bps": bw, "latency_s": lat} for n, (bw, lat) in sorted(links.items())}


def _link_text(numbers: LinkNumbers | None) -> str:
    if numbers is None:
        return "absent"
    return f"{numbers[0] / 1e9:g} GB/s, {numbers[1] * 1e6:g} us"


def read_hardware_info(value: Any, where: str) -> HardwareInfo | None:
    """Reads a ``hardware_profile`` object strictly (``where`` names the file).

    Raises:
        UserError: not null nor an object of the form above, a number that is not finite or
            out of range, or a ``digest`` that does not match the numbers (a hand-edited file).
    """
    if value is None:
        return None
    what = f"{where}: field 'hardware_profile'"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise UserError(f"{what} must be null or an object with a 'name', got {value!r}")
    links = _read_links(value.get("links"), what)
    rate = value.get("prefill_tokens_per_s")
    if rate is not None and not _finite(rate, positive=True):
        raise UserError(f"{what}: 'prefill_tokens_per_s' must be null or a finite number > 0, got {rate!r}")
    network = value.get("network")
    if network is not None:
        if not isinstance(network, dict) or not isinstance(network.get("name"), str):
            raise UserError(f"{what}: 'network' must be null or an object with a 'name' and 'links', got {network!r}")
        network = NetworkInfo(network["name"], _read_links(network.get("links"), f"{what}: network"))
    model = value.get("prefill_model", LEGACY_PREFILL_MODEL)
    if not isinstance(model, str):
        raise UserError(f"{what}: 'prefill_model' must be a string, got {model!r}")
    prefill = read_prefill_info(value.get("prefill"), what)
    info = HardwareInfo(value["name"], links, None if rate is None else float(rate), network, model, prefill)
    if value.get("digest") != info.digest:
        raise UserError(f"{what}: 'digest' {value.get('digest')!r} does not match its numbers ({info.digest}); "
                        "the file was edited by hand: re-run the replay")
    return info


def _read_links(value: Any, what: str) -> dict[str, LinkNumbers]:
    if not isinstance(value, dict):
        raise UserError(f"{what}: 'links' must be an object, got {value!r}")
    links = {}
    for name, spec in value.items():
        if (not isinstance(spec, dict) or set(spec) != {"bandwidth_Bps", "latency_s"}
                or not _finite(spec["bandwidth_Bps"], positive=True) or not _finite(spec["latency_s"], positive=False)):
            raise UserError(f"{what}: links[{name!r}] must be {{'bandwidth_Bps': > 0, 'latency_s': >= 0}}, got {spec!r}")
        links[name] = (float(spec["bandwidth_Bps"]), float(spec["latency_s"]))
    return links


def _finite(value: Any, positive: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and (value > 0 if positive else value >= 0)
