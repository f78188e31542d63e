"""Link and cost model of a machine: how long moving KV bytes between tiers takes.

A transfer of ``n`` bytes in ``k`` separate transfers over a link costs
``k * latency_s + n / bandwidth_Bps`` seconds: the latency is paid per transfer (per DMA
submission or per I/O request), the bandwidth per byte. The simulated transfer engine
completes jobs after this time, so the numbers here decide what a replay reports.

Directed links are named ``"src->dst"`` over the tiers hbm, dram, nvme. A profile must
define ``dram->hbm``, ``hbm->dram``, ``nvme->dram`` and ``dram->nvme``; ``nvme->hbm`` and
``hbm->nvme``, unless given explicitly (GPUDirect Storage), are staged through DRAM and
cost the sum of both hops (no overlap between the hops of one transfer is assumed).

A profile's ``prefill_tokens_per_s`` is the prefill speed of the reference model,
``REFERENCE_MODEL`` (Llama-3-8B, ``REFERENCE_PARAMS`` parameters), on short prompts, where
attention is negligible (~1% of the FLOPs at 512 tokens): it gives the machine's effective
FLOP rate ``prefill_flops_per_s = prefill_tokens_per_s * 2 * REFERENCE_PARAMS`` (weight FLOPs
per token are about ``2 P``). ``tiercache.sim.prefill`` charges a model's prefill, attention
over the context included, at that rate; ``prefill_rate(layout)`` is a model's short-prompt
tokens/s (the rate times ``REFERENCE_PARAMS / P``). A rate measured at ``m``-token prompts on
a model of ``P`` parameters, ``L`` layers, ``H`` query heads of dim ``d`` is the reference
rate ``r_m * (2 P + 2 L H d (m + 1)) / (2 * REFERENCE_PARAMS)``.

A shared remote tier (a fleet replay, ``tiercache replay --instances``) adds the network
links ``remote->dram`` and ``dram->remote`` (``with_network`` and the ``NETWORK_PRESETS``); ``remote->hbm`` and
``hbm->remote`` are staged through DRAM unless given (GPUDirect RDMA).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from tiercache.errors import UserError
from tiercache.results.outfile import replace_file

from .tracelines import first_repeated_key

__all__ = ["Link", "HardwareProfile", "PRESETS", "REFERENCE_MODEL", "REFERENCE_PARAMS", "REQUIRED_LINKS", "NETWORK_PRESETS", "with_network", "load_profile",
           "save_profile"]

#: The model whose prefill speed a profile's ``prefill_tokens_per_s`` is, and its parameter count
#: (its public config; ``MODEL_PRESETS["llama-3-8b"].params``).
REFERENCE_MODEL = "llama-3-8b"
REFERENCE_PARAMS = 8_030_261_248

#: Links every profile defines.
REQUIRED_LINKS = ("dram->hbm", "hbm->dram", "nvme->dram", "dram->nvme")
#: Links that may be given explicitly and otherwise are staged through DRAM.
STAGED_LINKS = {"nvme->hbm": ("nvme->dram", "dram->hbm"), "hbm->nvme": ("hbm->dram", "dram->nvme"),
                "remote->hbm": ("remote->dram", "dram->hbm"), "hbm->remote": ("hbm->dram", "dram->remote")}
#: The network links of a shared remote tier (optional: a machine without one has none).
NETWORK_LINKS = ("remote->dram", "dram->remote")


#: The fields of a profile JSON: all required, no other.
PROFILE_FIELDS = ("name", "links", "prefill_tokens_per_s")

#: What a profile JSON may give, (low, high, unit), both ends included. Physically sane
#: ranges (a KV link between 1 MB/s and 1 PB/s, at most 10 s per transfer; a prefill of 1
#: to 10^9 tokens/s); they also keep every modeled figure finite (a latency of 1e308 s or a
#: bandwidth of 1e-300 B/s would turn a replay's seconds into infinity).
BANDWIDTH_RANGE = (1e6, 1e15, "B/s")
LATENCY_RANGE = (0.0, 10.0, "s")
PREFILL_RANGE = (1.0, 1e9, "tokens/s")


def _as_float(value: Any, what: str, bound: str) -> float:
    """``value`` as a float: an int or a float, never a bool or a string; an int too large
    for a float becomes infinity (so the caller's range check refuses it, by name)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{what}: must be a number {bound}, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _shown(value: Any) -> str:
    """``value`` for an error message; an integer too long to read is shown by its length."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


def _positive_number(value: Any, what: str, allow_zero: bool = False) -> float:
    """A finite float > 0 (or >= 0); bools and strings are rejected."""
    bound = ">= 0" if allow_zero else "> 0"
    number = _as_float(value, what, f"(finite, {bound})")
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        raise UserError(f"{what}: must be a finite number {bound}, got {_shown(value)}")
    return number


def _number_in(value: Any, what: str, accepted: tuple[float, float, str]) -> float:
    """A float within ``accepted`` (low, high, unit; both ends included), for a profile JSON.

    Raises:
        UserError: not a number, or outside the range; names ``what`` and the range.
    """
    low, high, unit = accepted
    bound = f"from {low:g} to {high:g} {unit}"
    number = _as_float(value, what, bound)
    if not low <= number <= high:  # NaN fails too
        raise UserError(f"{what}: must be a number {bound}, got {_shown(value)}")
    return number


@dataclass(frozen=True)
class Link:
    """One directed link. Invariants: ``bandwidth_Bps > 0``, ``latency_s >= 0``, both finite."""

    bandwidth_Bps: float
    latency_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth_Bps", _positive_number(self.bandwidth_Bps, "Link.bandwidth_Bps"))
        object.__setattr__(self, "latency_s", _positive_number(self.latency_s, "Link.latency_s", allow_zero=True))

    def seconds(self, nbytes: int | float, ntransfers: int = 1) -> float:
        """Time to move ``nbytes`` in ``ntransfers`` transfers: latency per transfer + bytes / bandwidth."""
        if nbytes < 0 or ntransfers < 0:
            raise ValueError(f"Link.seconds: nbytes and ntransfers must be >= 0, got {nbytes}, {ntransfers}")
        return ntransfers * self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class HardwareProfile:
    """A named machine: its links and prefill throughput.

    Invariants: ``links`` holds every name in ``REQUIRED_LINKS`` and only names of the form
    ``"src->dst"`` over hbm/dram/nvme (and remote: both ``NETWORK_LINKS`` or neither, never
    one alone, which a fleet replay would otherwise replace by a preset); it is read-only.
    ``prefill_tokens_per_s > 0`` is ``REFERENCE_MODEL``'s short-prompt prefill rate, which gives
    the FLOP rate recompute is charged at (``prefill_flops_per_s``), or None when the profile has none (``tiercache bench`` measures links, not prefill): such a
    profile models link seconds only, and ``require_prefill`` refuses recompute and TTFT.
    ``source`` is the JSON file it was read from (None for a preset), named in its errors.
    """

    name: str
    links: Mapping[str, Link] = field(hash=False)
    prefill_tokens_per_s: float | None
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        missing = [n for n in REQUIRED_LINKS if n not in self.links]
        unknown = [n for n in self.links if n not in REQUIRED_LINKS and n not in STAGED_LINKS and n not in NETWORK_LINKS]
        if missing or unknown:
            raise UserError(f"hardware profile {self.name!r}: missing links {missing}, unknown links {unknown}")
        network = [n for n in NETWORK_LINKS if n in self.links]
        if len(network) == 1:
            (given,) = network
            (absent,) = [n for n in NETWORK_LINKS if n != given]
            raise UserError(f"hardware profile {self.name!r}: links[{given!r}] is given but links[{absent!r}] is missing; "
                            "a shared tier's network needs both directions (or neither: --network then picks a preset)")
        object.__setattr__(self, "links", MappingProxyType(dict(self.links)))
        if self.prefill_tokens_per_s is not None:
            rate = _positive_number(self.prefill_tokens_per_s, f"hardware profile {self.name!r}: prefill_tokens_per_s")
            object.__setattr__(self, "prefill_tokens_per_s", rate)

    def require_prefill(self) -> "HardwareProfile":
        """This profile, checked to have a prefill speed (recompute time and TTFT need one).

        Raises:
            UserError: ``prefill_tokens_per_s`` is null; the message names the file (``source``)
                and says how to add it.
        """
        if self.prefill_tokens_per_s is None:
            where = f"{self.source}: " if self.source else ""
            raise UserError(
                f"{where}hardware profile {self.name!r} has no prefill speed (prefill_tokens_per_s is null: tiercache bench "
                "measures links, not prefill); recompute time and TTFT need one: set it in the profile JSON to the "
                f"prefill tokens/s of {REFERENCE_MODEL} on short prompts (~512 tokens) on your GPU")
        return self

    def link(self, name: str) -> Link:
        """The link of that name; a staged path (``nvme->hbm``) only if given explicitly."""
        if name not in self.links:
            raise KeyError(f"hardware profile {self.name!r} has no link {name!r}; known: {', '.join(self.links)}")
        return self.links[name]

    def seconds(self, path: str, nbytes: int | float, ntransfers: int = 1) -> float:
        """Transfer time over ``path``; a staged path not given explicitly sums its two hops."""
        if path in self.links:
            return self.links[path].seconds(nbytes, ntransfers)
        if path in STAGED_LINKS:
            return sum(self.links[hop].seconds(nbytes, ntransfers) for hop in STAGED_LINKS[path])
        raise KeyError(f"hardware profile {self.name!r} has no link {path!r}")

    def prefill_rate(self, layout: Any = None) -> float:
        """Short-prompt prefill tokens/s of ``layout``'s model (weights only: attention over the
        context is ``tiercache.sim.prefill``'s): ``prefill_tokens_per_s`` (the reference model's)
        times ``REFERENCE_PARAMS / layout.params``; unscaled for no layout or a layout whose
        ``params`` is None. Equal to ``prefill_tokens_per_s`` for llama-3-8b.

        Raises:
            UserError: the profile has no prefill speed.
        """
        rate = self.require_prefill().prefill_tokens_per_s
        params = getattr(layout, "params", None)
        return rate if params is None or params == REFERENCE_PARAMS else rate * REFERENCE_PARAMS / params

    @property
    def prefill_flops_per_s(self) -> float:
        """The machine's effective prefill FLOP rate: ``prefill_tokens_per_s * 2 * REFERENCE_PARAMS``.

        Raises:
            UserError: the profile has no prefill speed.
        """
        return self.require_prefill().prefill_tokens_per_s * 2 * REFERENCE_PARAMS


def _profile(
    name: str, h2d: float, d2h: float, pcie_lat: float, nvme_r: float, nvme_w: float, nvme_lat: float, prefill: float
) -> HardwareProfile:
    links = {
        "dram->hbm": Link(h2d, pcie_lat),
        "hbm->dram": Link(d2h, pcie_lat),
        "nvme->dram": Link(nvme_r, nvme_lat),
        "dram->nvme": Link(nvme_w, nvme_lat),
    }
    return HardwareProfile(name, links, prefill)


# Sources and assumptions (order-of-magnitude planning numbers, not measurements of one box):
# * PCIe Gen5 x16 is 64 GB/s raw per direction; pinned cudaMemcpyAsync reaches ~50-56 GB/s,
#   so 55 GB/s. Gen4 x16 is 32 GB/s raw, ~25 GB/s effective. Per-transfer cost (driver
#   submission + DMA setup) ~10 us.
# * NVLink-C2C (GH200) is 900 GB/s total, 450 GB/s per direction; latency to LPDDR5X a few us.
# * NVMe: one Gen4 x4 enterprise drive ~7 GB/s sequential read / ~5 GB/s write; Gen5 x4
#   ~14 GB/s read / ~10 GB/s write. ~80 us per I/O for Gen4 (QD1 4K read latency of TLC
#   drives), ~60 us for Gen5. A RAID of drives is a custom JSON profile.
# * Prefill throughput of the reference model (REFERENCE_MODEL, Llama-3-8B, ~16 GFLOP per
#   token with 2 * params FLOPs; other models scale by their parameter count) at ~45 % MFU of the dense bf16 peak: H100/H200/GH200 989 TFLOPS ->
#   ~28k tokens/s (H100 a little lower: less HBM bandwidth for attention); A100 312 TFLOPS
#   -> ~9k tokens/s. These are short-prompt rates (weights only); tiercache.sim.prefill adds
#   the attention FLOPs of long prompts at the same FLOP rate.
PRESETS: dict[str, HardwareProfile] = {
    # Arguments: H2D, D2H B/s, PCIe/C2C latency s, NVMe read, write B/s, NVMe latency s, prefill tok/s.
    # Literals rather than products (10 * 1e-6 != 10e-6) so saved JSON shows the round numbers.
    "h200-pcie5-nvme4": _profile("h200-pcie5-nvme4", 55e9, 55e9, 10e-6, 7e9, 5e9, 80e-6, 28_000),
    "h100-pcie5-nvme4": _profile("h100-pcie5-nvme4", 55e9, 55e9, 10e-6, 7e9, 5e9, 80e-6, 25_000),
    "gh200-c2c-nvme5": _profile("gh200-c2c-nvme5", 450e9, 450e9, 3e-6, 14e9, 10e9, 60e-6, 28_000),
    "a100-pcie4-nvme4": _profile("a100-pcie4-nvme4", 25e9, 25e9, 10e-6, 7e9, 5e9, 80e-6, 9_000),
}


# Network presets for the shared tier, per direction, as one client sees it: 25 Gb/s
# Ethernet with TCP reaches ~2.8 GB/s (90 % of 3.125 GB/s) at ~50 us per request (kernel
# stack, a Mooncake RPC); 200/400 Gb/s RDMA NICs reach ~23/46 GB/s at ~5 us per transfer.
NETWORK_PRESETS: dict[str, Link] = {
    "tcp-25g": Link(2.8e9, 50e-6),
    "rdma-200g": Link(23e9, 5e-6),
    "rdma-400g": Link(46e9, 5e-6),
}


def with_network(profile: HardwareProfile, network: str) -> HardwareProfile:
    """``profile`` plus the links of a shared remote tier over a ``NETWORK_PRESETS`` network.

    Raises:
        UserError: an unknown preset; the message lists the known ones.
    """
    if network not in NETWORK_PRESETS:
        raise UserError(f"unknown network preset {network!r}; known: {', '.join(NETWORK_PRESETS)}")
    link = NETWORK_PRESETS[network]
    links = {**profile.links, "remote->dram": link, "dram->remote": link}
    return HardwareProfile(f"{profile.name}+{network}", links, profile.prefill_tokens_per_s, profile.source)


def load_profile(name_or_path: str | os.PathLike) -> HardwareProfile:
    """A preset by name, or a profile from a JSON file (see ``save_profile`` for the schema).

    A file is read as strictly as a trace: exactly the fields ``PROFILE_FIELDS``, a name that
    is not blank, no key twice in any object, and bandwidths, latencies and prefill speed in
    ``BANDWIDTH_RANGE``, ``LATENCY_RANGE`` and ``PREFILL_RANGE``.

    Raises:
        UserError: neither a preset nor an existing file (the message lists the presets), or
            a malformed file (the message names the file and the field or key, and the
            accepted range of a value outside it).
    """
    text = os.fspath(name_or_path)
    if text in PRESETS:
        return PRESETS[text]
    if not os.path.exists(text):
        raise UserError(f"unknown hardware profile {text!r}: not a preset (known: {', '.join(PRESETS)}) nor a JSON file")
    if not os.path.isfile(text):  # a FIFO would block the read, a device never end it
        raise UserError(f"{text}: cannot read hardware profile: not a regular file (a folder, device, FIFO or socket)")
    try:
        with open(text, encoding="utf-8") as handle:
            data = json.load(handle, object_pairs_hook=_keys_once)
    except UserError as exc:  # a repeated key (_keys_once)
        raise UserError(f"{text}: {exc}") from None
    except (OSError, ValueError, RecursionError, MemoryError) as exc:
        raise UserError(f"{text}: cannot read hardware profile: {exc or type(exc).__name__}") from None
    return _profile_from_json(text, data)


def _keys_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json``'s ``object_pairs_hook`` for a profile: the object, refusing a repeated key
    (which value is meant is ambiguous; the trace readers refuse it too)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise UserError(f"key {first_repeated_key(pairs)!r} appears more than once in an object "
                        "(which value is meant is ambiguous)")
    return obj


def _profile_from_json(path: str, data: Any) -> HardwareProfile:
    """Builds a profile from parsed JSON; errors are prefixed with the file's path."""
    if not isinstance(data, dict):
        raise UserError(f"{path}: a hardware profile must be a JSON object, got {type(data).__name__}")
    for key in PROFILE_FIELDS:
        if key not in data:
            raise UserError(f"{path}: missing field {key!r}")
    unknown = [key for key in data if key not in PROFILE_FIELDS]
    if unknown:
        raise UserError(f"{path}: unknown field {unknown[0]!r}; a hardware profile has exactly {', '.join(PROFILE_FIELDS)}")
    _check_profile_name(path, data["name"])
    if not isinstance(data["links"], dict):
        raise UserError(f"{path}: 'links' must be an object, got {type(data['links']).__name__}")
    try:
        links = {name: link_from_json(name, spec) for name, spec in data["links"].items()}
        rate = data["prefill_tokens_per_s"]  # null: no prefill speed
        rate = None if rate is None else _number_in(rate, "prefill_tokens_per_s", PREFILL_RANGE)
        profile = HardwareProfile(data["name"], links, rate, path)
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None
    mismatch = _preset_name_mismatch(profile)
    if mismatch:  # results and reports would name the preset(s)
        raise UserError(f"{path}: hardware profile name {profile.name!r} is a preset's, but {mismatch}; "
                        "give the profile a name of its own")
    return profile


def _check_profile_name(path: str, name: Any) -> None:
    """Refuses a profile name results and reports could not show as it is, or that could pass
    for a preset it is not: empty, not printable ASCII (a zero-width space, a Unicode dash or
    plus, a Cyrillic letter that looks Latin), with surrounding whitespace, ``none`` (what a
    report shows without hardware), a part spelled like a preset but not the same
    (``_skeleton``: another case, spaces or underscores for dashes, O for 0), or a network
    preset as the machine.

    Raises:
        UserError: naming ``path`` and what is wrong with the name.
    """
    if not isinstance(name, str) or not name.strip():  # results and reports name the profile by it
        shown = repr(name) if isinstance(name, str) else type(name).__name__
        raise UserError(f"{path}: 'name' must be a non-empty string, got {shown}")
    odd = next((c for c in name if not " " <= c <= "~"), None)
    if odd is not None:
        raise UserError(f"{path}: 'name' {name!r} has a character other than printable ASCII (U+{ord(odd):04X}); "
                        "results and reports show the name as it is, so it must not pass for another")
    if name != name.strip():
        raise UserError(f"{path}: 'name' {name!r} starts or ends with whitespace; reports would show it as another name")
    if name.casefold() == "none":
        raise UserError(f"{path}: 'name' {name!r} reads as no hardware in reports; give the profile a name of its own")
    presets = [*PRESETS, *NETWORK_PRESETS]
    for part in name.split("+"):
        lookalike = next((p for p in presets if part != p and _skeleton(part) == _skeleton(p)), None)
        if lookalike is not None:
            raise UserError(f"{path}: 'name' {name!r} spells {part!r} like preset {lookalike!r} but not as it; "
                            "give the profile a name of its own")
    if name.split("+")[0] in NETWORK_PRESETS:
        raise UserError(f"{path}: 'name' {name!r} names network preset {name.split('+')[0]!r} as the machine; "
                        "give the profile a machine name of its own")


#: Letters a reader takes for digits in a preset's name.
_LOOKS_LIKE = str.maketrans({"o": "0", "l": "1", "i": "1"})


def _skeleton(text: str) -> str:
    """``text`` (printable ASCII) as a reader would take it: case-folded, O as 0 and l or I as
    1, every run of dashes, underscores and spaces as one dash, none at either end."""
    return re.sub(r"[-_ ]+", "-", text.casefold().translate(_LOOKS_LIKE)).strip("-")


def safe_profile_name(text: str) -> str:
    """``text`` with every character a profile name may not hold, and every '+' (which
    separates a network preset), replaced by '-': for names made from outside data, such as
    a host's name."""
    return re.sub(r"[^ -*,-~]", "-", text).strip() or "-"


def _preset_name_mismatch(profile: HardwareProfile) -> str:
    """What differs between ``profile`` and the presets its name names ('' when nothing does, or
    when it names none). A name names presets as ``with_network`` builds them: a machine preset
    (``PRESETS``), optionally followed by ``+network`` parts (``NETWORK_PRESETS``; the last one's
    links are the shared tier's); ``X+network`` with ``X`` not a machine preset names the network
    only (results record it as machine ``X`` over that network)."""
    parts = profile.name.split("+")
    machine_end = len(parts)
    while machine_end > 1 and parts[machine_end - 1] in NETWORK_PRESETS:
        machine_end -= 1
    machine, networks = "+".join(parts[:machine_end]), parts[machine_end:]
    problems = []
    if networks and any(profile.links.get(n) != NETWORK_PRESETS[networks[-1]] for n in NETWORK_LINKS):
        problems.append(f"its {' and '.join(NETWORK_LINKS)} links are not those of network preset {networks[-1]!r}")
    preset = PRESETS.get(machine)
    if preset is not None:
        local = {n: l for n, l in profile.links.items() if n not in NETWORK_LINKS or not networks}
        if local != dict(preset.links) or profile.prefill_tokens_per_s != preset.prefill_tokens_per_s:
            problems.append(f"its links or prefill speed are not those of machine preset {machine!r}")
    return " and ".join(problems)


def link_from_json(name: str, spec: Any) -> Link:
    """One link of a profile JSON, its values within ``BANDWIDTH_RANGE`` and ``LATENCY_RANGE``."""
    if not isinstance(spec, dict) or set(spec) != {"bandwidth_Bps", "latency_s"}:
        raise UserError(f"links[{name!r}]: must be an object with exactly 'bandwidth_Bps' and 'latency_s', got {spec!r}")
    bandwidth = _number_in(spec["bandwidth_Bps"], f"links[{name!r}].bandwidth_Bps", BANDWIDTH_RANGE)
    latency = _number_in(spec["latency_s"], f"links[{name!r}].latency_s", LATENCY_RANGE)
    return Link(bandwidth, latency)


def save_profile(profile: HardwareProfile, path: str | os.PathLike) -> None:
    """Writes a profile as JSON: ``{"name", "links": {name: {"bandwidth_Bps", "latency_s"}}, "prefill_tokens_per_s"}``.

    Raises:
        UserError: the file cannot be written.
    """
    data = {
        "name": profile.name,
        "links": {n: {"bandwidth_Bps": l.bandwidth_Bps, "latency_s": l.latency_s} for n, l in profile.links.items()},
        "prefill_tokens_per_s": profile.prefill_tokens_per_s,
    }
    replace_file(path, json.dumps(data, indent=2) + "\n", f"{os.fspath(path)}: hardware profile")
