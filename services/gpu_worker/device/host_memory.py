"""Handing freed heap memory back to the operating system when the engine goes idle.

Under load the engine's steps allocate and free activations, logits and sampler tensors of every
batch shape, and gRPC threads allocate request and response buffers; glibc keeps what is freed in
its arenas for reuse (one arena per thread that allocated, up to 8 per core), so a worker's
resident memory rises to the high-water mark of the busiest minute and stays there after the load
is gone (issue 22: the soak's surviving worker settled 11% above its post-warm-up RSS). None of it
is in use: ``malloc_trim(0)`` returns the free pages of every arena (glibc >= 2.8 also releases
free pages inside the heap with ``madvise``), so the settled RSS is again what the worker holds.

The engine calls :func:`release_free_heap` once per idle period (nothing waiting or running), after
it stepped, never between steps: a trim takes milliseconds and walks every arena under its locks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)


def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def release_free_heap() -> bool:
    """Return the allocator's free memory to the OS; False where the C library cannot."""
    if _TRIM is None:
        return False
    _TRIM(0)  # ctypes releases the GIL for the call
    return True
