"""Page-locked host memory of exactly the size asked for, registered with CUDA.

torch's pinned allocator (``pin_memory=True``) rounds every allocation up to a power of two
and keeps freed blocks cached for reuse: a 40 GiB DRAM tier would lock 64 GiB of host
memory, more than ``check_host_memory`` counted, and keep it locked after the store closes.
A pool instead takes an anonymous mmap of its own size (page aligned, as O_DIRECT wants) and
registers it with ``cudaHostRegister``, as SGLang's host KV pools do. The registration ends
when the pool's owner is collected, after every device's copies are done; while a CUDA graph
is being captured (where a synchronise would break the capture) it ends at the next
registration or collection instead, the memory kept alive until then.
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
#: Registrations whose end came during a graph capture: ``(cudart, pointer, buffer)``.
_deferred: list[tuple] = []


class Registration:
    """Owns a registered mmap: keeps the memory alive while registered, unregisters when
    collected (``weakref.finalize``, which holds the mmap until its callback has run)."""

    def __init__(self, buffer, pointer: int, cudart) -> None:
        self._finalizer = weakref.finalize(self, _unregister, cudart, pointer, buffer)
        self._finalizer.atexit = False  # the process's exit unmaps everything anyway


def _capturing() -> bool:
    """Whether this thread's current stream is capturing a CUDA graph (False if unknowable)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 - a torch without the query, or CUDA gone: no capture
        return False


def _unregister(cudart, pointer: int, buffer) -> None:
    """Ends a registration once every device's copies are done (a copy stream may read it),
    or, during a graph capture, later (``_deferred``). Errors are only logged: this runs
    from the garbage collector."""
    if _capturing():
        _deferred.append((cudart, pointer, buffer))
        return
    try:
        for device in range(torch.cuda.device_count()):
            torch.cuda.synchronize(device)
        error = int(cudart.cudaHostUnregister(pointer))
    except Exception as exc:  # noqa: BLE001 - a finalizer must not raise
        log.warning("cudaHostUnregister of a pool's host memory failed: %s", exc)
        return
    if error:
        _clear_error(cudart)
        log.warning("cudaHostUnregister of a pool's host memory failed with cudaError %d", error)


def _end_deferred() -> None:
    """Ends the registrations deferred by a graph capture, once none is running."""
    while _deferred and not _capturing():
        _unregister(*_deferred.pop())


def _clear_error(cudart) -> None:
    """Clears CUDA's sticky last error after a failed runtime call, so that the next kernel
    launch on this thread does not report it as its own."""
    get_last_error = getattr(cudart, "cudaGetLastError", None)
    if get_last_error is not None:
        try:
            get_last_error()
        except Exception:  # noqa: BLE001 - best effort
            pass


def registered_tensor(shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, object, bool]:
    """A zeroed, page-aligned host tensor of ``shape``, registered with CUDA when it can be.

    Returns:
        ``(tensor, owner, pinned)``: keep ``owner`` alive as long as the tensor is used for
        asynchronous copies. ``pinned`` is False (ordinary memory, a warning logged) where
        CUDA cannot start (a broken driver, a forked child of a CUDA process) or
        ``cudaHostRegister`` fails; the tensor is usable either way.
    """
    _end_deferred()
    tensor, buffer = aligned_tensor(shape, dtype)
    pointer = tensor.data_ptr()
    try:
        cudart = torch.cuda.cudart()
        error = int(cudart.cudaHostRegister(pointer, len(buffer), _PORTABLE))
    except RuntimeError as exc:  # CUDA present but not usable here
        log.warning("pinning a pool's host memory failed (%s); it uses ordinary memory (host-device copies will "
                    "not overlap compute)", str(exc).splitlines()[0])
        return tensor, buffer, False
    if error:
        _clear_error(cudart)
        log.warning("cudaHostRegister of %d bytes failed with cudaError %d; this pool uses ordinary memory "
                    "(host-device copies will not overlap compute)", len(buffer), error)
        return tensor, buffer, False
    return tensor, Registration(buffer, pointer, cudart), True
