"""The checks ``TieredKVCache`` makes of its options before it opens anything: numeric
options in range, no remote tier, and no write-through hierarchy whose lower tiers admit
selectively."""

from __future__ import annotations

import sys

from tiercache.config import REMOTE_TIER
from tiercache.errors import UserError
from tiercache.policies import make_admission
from tiercache.policies.admission_always import AlwaysAdmit

__all__ = ["check_options", "refuse_remote", "refuse_gated_copies"]


def check_options(window_blocks, depth, sink_blocks, recent_blocks, speculate, keep_reports) -> None:
    """Raises UserError naming the first of ``TieredKVCache``'s numeric options that is out of
    range (checked before anything is opened)."""
    for name, value, low in (("window_blocks", window_blocks, 1), ("depth", depth, 1), ("sink_blocks", sink_blocks, 0),
                             ("recent_blocks", recent_blocks, 0), ("keep_reports", keep_reports, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UserError(f"TieredKVCache: {name} must be an integer >= {low}, got {value!r}")
    if keep_reports > sys.maxsize:  # already keeps every report; more overflowed a C ssize_t (the reports' bound)
        raise UserError(f"TieredKVCache: keep_reports must be at most sys.maxsize ({sys.maxsize}: keeps every report), "
                        f"got {keep_reports!r}")
    if isinstance(speculate, bool) or not isinstance(speculate, (int, float)) or not 0 <= speculate <= 4:
        raise UserError(f"TieredKVCache: speculate must be a share of the budget in [0, 4], got {speculate!r}")


def refuse_remote(tiers) -> None:
    """Raises UserError when ``tiers`` names a ``remote`` (Mooncake) tier: the decode loop
    reads a sequence's blocks where they lie, straight into its window buffers, which a remote
    value cannot be read into (an attend over a block demoted there crashed). The shared tier
    is ``TieredKVStore``'s (``put_tokens``, ``get_prefix``)."""
    for tier in tiers if isinstance(tiers, (list, tuple)) else ():  # anything else: the store's checks name it
        if str(getattr(tier, "name", "")).lower() == REMOTE_TIER:
            raise UserError("TieredKVCache: a remote (Mooncake) tier is not supported by the decode cache: it reads "
                            "blocks where they lie, and a remote value cannot be read in place; share KV through "
                            "TieredKVStore (put_tokens, get_prefix) with the remote tier")


def refuse_gated_copies(tiers, admission: str | None, write_through: bool) -> None:
    """Raises UserError for a write-through hierarchy whose lower tiers admit blocks
    selectively (``admission``, or a ``TierConfig``'s, other than ``AlwaysAdmit`` itself): write-through
    drops an HBM victim instead of moving it down, so a sequence's block whose copies were
    refused could only stay in HBM, and held blocks would pin it (an append that fits refused,
    and a replay of the recorded steps counting otherwise)."""
    if not write_through or not isinstance(tiers, (list, tuple)):
        return  # anything else: the store's checks name it
    names = [admission or getattr(t, "admission", "always") for t in tiers[1:]]
    # make_admission names an unknown policy, or one that is no name (PolicyError); AlwaysAdmit by
    # any name passes (a subclass may refuse: it does not)
    gated = sorted({str(n) for n in names if type(make_admission(n)) is not AlwaysAdmit})
    if gated:
        raise UserError(f"TieredKVCache: write_through=True with admission {', '.join(gated)}: a write-through "
                        "hierarchy drops HBM victims instead of moving them down, so a sequence's block whose lower "
                        "copies were refused could only stay in HBM; use admission 'always' with write_through, or "
                        "the exclusive hierarchy (write_through=False) with an admission policy")
