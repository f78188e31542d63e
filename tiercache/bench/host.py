"""The host a ``tiercache bench`` run ran on, in words: the facts of the ``machine`` section
of its JSON that do not depend on the run (host, CPUs, memory, filesystem), and the host
copy baseline's description. No torch here.
"""

from __future__ import annotations

import os
import platform

import psutil

__all__ = ["filesystem", "host_copy_kind", "host_facts"]


def host_facts(directory: str) -> dict:
    """Host name, platform, CPUs, memory and the filesystem holding ``directory``."""
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "filesystem": filesystem(directory),
    }


def host_copy_kind(threads: int) -> str:
    """The host copy baseline in words (host memory; no CUDA)."""
    split = f"the faster of one memmove and {threads} memmoves on {threads} threads" if threads > 1 else "one memmove"
    return f"{split} of the whole contiguous pool (host memory; no CUDA)"


def filesystem(directory: str) -> str:
    """Filesystem type and device of the mount holding ``directory``."""
    path = os.path.realpath(directory)
    best = None
    for part in psutil.disk_partitions(all=True):
        if path == part.mountpoint or path.startswith(part.mountpoint.rstrip("/") + "/"):
            if best is None or len(part.mountpoint) > len(best.mountpoint):
                best = part
    return f"{best.fstype} on {best.device} at {best.mountpoint}" if best else "unknown"
