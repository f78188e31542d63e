"""Page-locked host memory of exactly the size asked for, registered with CUDA.

torch's pinned allocator (``pin_memory=True``) rounds every allocation up to a power of two
and keeps freed blocks cached for reuse: a 40 GiB DRAM tier would lock 64 GiB of host
memory, more than ``check_host_memory`` counted, and keep it locked after the store closes.
A pool instead takes an anonymous mmap of its own size (page aligned, as O_DIRECT wants) and
registers it with ``cudaHostRegister``, as SGLang's host KV pools do; the registration ends
(after a device synchronise, so no copy still reads it) when the pool's owner is collected.
"""

from __future__ import annotations

import logging
import weakref
from typing import Sequence

import torch

from .buffers import aligned_tensor

__all__ = ["registered_tensor"]

log = logging.getLogger(__name__)
#: ``cudaHostRegisterPortable``: pinned for every CUDA context, not only the current one.
_PORTABLE = 1


class Registration:
    """Owns a registered mmap: keeps the memory alive while registered, unregisters when
    collected (``weakref.finalize``: the mmap is still referenced while the callback runs)."""

    def __init__(self, buffer, pointer: int, cudart) -> None:
        self.buffer = buffer
        self._finalizer = weakref.finalize(self, _unregister, cudart, pointer)
        self._finalizer.atexit = False  # the process's exit unmaps everything anyway


def _unregister(cudart, pointer: int) -> None:
    """Waits for the device's copies, then ends the registration (errors only logged: this
    runs from the garbage collector)."""
    try:
        torch.cuda.synchronize()
        error = int(cudart.cudaHostUnregister(pointer))
    except Exception as exc:  # noqa: BLE001 - a finalizer must not raise
        log.warning("cudaHostUnregister of a pool's host memory failed: %s", exc)
        return
    if error:
        log.warning("cudaHostUnregister of a pool's host memory failed with cudaError %d", error)


def registered_tensor(shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, object, bool]:
    """A zeroed, page-aligned host tensor of ``shape``, registered with CUDA when it can be.

    Returns:
        ``(tensor, owner, pinned)``: keep ``owner`` alive as long as the tensor is used for
        asynchronous copies. ``pinned`` is False (ordinary memory, a warning logged) when
        ``cudaHostRegister`` fails; the tensor is usable either way.
    """
    tensor, buffer = aligned_tensor(shape, dtype)
    cudart = torch.cuda.cudart()
    pointer = tensor.data_ptr()
    error = int(cudart.cudaHostRegister(pointer, len(buffer), _PORTABLE))
    if error:
        log.warning("cudaHostRegister of %d bytes failed with cudaError %d; this pool uses ordinary memory "
                    "(host-device copies will not overlap compute)", len(buffer), error)
        return tensor, buffer, False
    return tensor, Registration(buffer, pointer, cudart), True
