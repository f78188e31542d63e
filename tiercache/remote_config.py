"""Configuration of the shared remote tier (Mooncake Store): how to reach it
(``RemoteConfig``) and when blocks are written to it (``RemoteWrite``). Plain Python,
frozen and validated; ``tiercache.config`` re-exports both."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["RemoteConfig", "RemoteWrite", "MIN_SEGMENT_BYTES", "DEFAULT_WRITE_HITS"]

#: The smallest segment Mooncake's setup accepts ("Total size must be at least 16777216").
MIN_SEGMENT_BYTES = 16 << 20
#: Local hits after which ``selective`` publishes a block (``RemoteConfig.write_hits``'s default;
#: a fleet replay's ``--write-hits`` default too).
DEFAULT_WRITE_HITS = 2


class RemoteWrite(enum.Enum):
    """When a block is written to the shared remote tier (``remote_write``).

    ``THROUGH`` (the default): when it is first stored locally, so another instance (a
    decode node, a replica serving the same documents) finds it as soon as it exists; the
    point of a shared tier, for one put per new block. ``BACK``: when it leaves the last
    local tier (least traffic, but shared only once this instance no longer holds it).
    ``SELECTIVE``: once it has been hit ``write_hits`` times locally (hot blocks only).
    """

    THROUGH = "through"
    BACK = "back"
    SELECTIVE = "selective"


@dataclass(frozen=True)
class RemoteConfig:
    """How to reach the Mooncake Store of a ``remote`` tier, and when to write to it.

    Args:
        master: the master's RPC address, ``host:port`` (``tiercache remote-serve`` prints it).
        metadata: the metadata server URL, ``http://host:port/metadata``.
        local_host: this client's address as the others reach it (its transfer endpoint).
        segment_bytes: memory this client contributes to the shared pool: 0 (none; it then
            only reads and writes what other clients hold) or at least 16 MiB (Mooncake's
            minimum: its setup refuses anything smaller, so the client would never connect).
        buffer_bytes: the client's local transfer buffer.
        protocol: ``tcp`` (here), ``rdma`` on clusters; ``device``: the RDMA device names.
        write: the write policy (``RemoteWrite``); ``write_hits``: the selective threshold.
        timeout_s: longest wait for a lookup; ``retry_s``: how long remote calls are skipped
            after a failure before the next one tries again (the master may be back).
        staging_blocks: registered blocks for transfers that cannot read or write the pools
            in place (NVMe and GPU blocks, blocks read in place).
    """

    master: str
    metadata: str
    local_host: str = "127.0.0.1"
    segment_bytes: int = 256 << 20
    buffer_bytes: int = 64 << 20
    protocol: str = "tcp"
    device: str = ""
    write: RemoteWrite = RemoteWrite.THROUGH
    write_hits: int = DEFAULT_WRITE_HITS
    timeout_s: float = 5.0
    retry_s: float = 1.0
    staging_blocks: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.write, RemoteWrite):
            raise ConfigError(f"RemoteConfig.write must be a RemoteWrite ({', '.join(w.value for w in RemoteWrite)}), got {self.write!r}")
        for name in ("master", "metadata", "local_host", "protocol", "device"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"RemoteConfig.{name} must be a str, got {type(getattr(self, name)).__name__} "
                                  f"{getattr(self, name)!r}")
        if not self.local_host or not self.protocol:
            raise ConfigError(f"RemoteConfig: local_host and protocol must not be empty, got {self.local_host!r} and "
                              f"{self.protocol!r}")
        if not re.fullmatch(r"[^:\s]+:[0-9]{1,5}", str(self.master)):
            raise ConfigError(f"RemoteConfig.master must be host:port, got {self.master!r}")
        if not str(self.metadata).startswith(("http://", "etcd://")) and self.metadata != "P2PHANDSHAKE":
            raise ConfigError(f"RemoteConfig.metadata must be an http://host:port/metadata URL, got {self.metadata!r}")
        for name in ("segment_bytes", "buffer_bytes", "write_hits", "staging_blocks", "timeout_s", "retry_s"):
            value, may_be_zero = getattr(self, name), name in ("segment_bytes", "retry_s")
            kind = "number of seconds" if name.endswith("_s") else "integer"
            wrong_type = not isinstance(value, (int, float) if kind != "integer" else int) or isinstance(value, bool)
            # ``0 <= value < inf`` is False for NaN too; seconds must fit the client's timers.
            if wrong_type or not 0 <= value < (1e9 if kind != "integer" else float("inf")) or (value == 0 and not may_be_zero):
                bound = "" if kind == "integer" else " below 1e9"
                raise ConfigError(f"RemoteConfig.{name} must be a {'non-negative' if may_be_zero else 'positive'} "
                                  f"{kind}{bound}, got {value!r}")
        if 0 < self.segment_bytes < MIN_SEGMENT_BYTES:
            raise ConfigError(f"RemoteConfig.segment_bytes must be 0 (no segment) or at least 16 MiB ({MIN_SEGMENT_BYTES}, "
                              f"Mooncake's minimum: its setup refuses less and the client never connects), got {self.segment_bytes!r}")
