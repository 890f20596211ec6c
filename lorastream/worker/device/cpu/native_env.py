"""Settings of torch's native libraries for the worker's CPU compute, in place before torch loads;
:func:`release_freed_memory`, called once the model is built; and :func:`keep_freed_buffers`, for
the processes that receive adapter streams.

GNU OpenMP (torch's intra-op threading on Linux) reads its environment once, when torch is
imported, and oneDNN and ideep read theirs when they first build a primitive, so the commands
that compute (``worker serve``, ``bench engine``) call :func:`tune_native_libraries` first thing:

* OpenMP's spin-waits are shortened to about a millisecond (``GOMP_SPINCOUNT``, below);
* oneDNN's primitive cache and ideep's cache of prepared products hold 64 entries instead of
  1,024 (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``).

The caches: the prepacked projections (``model/linear.py``) run on oneDNN, which builds a
primitive (JIT kernel, scratchpad) for each input shape, and ideep keeps one more object per
shape; both are keyed by the row count, which a worker takes anywhere from 1 to its token
budget. At 1,024 entries each they hold hundreds of MB once filled, and a soak's RSS grows
until they are full. Both caches count; at 64 each the growth is small and a round over every
row count takes the same time: building a primitive costs little next to the layers that use
it. One step needs ~6 shapes (its row count, the lm_head's rows), so 64 keeps a few steps'
worth (measured: docs/notes/engine.md, "oneDNN's and ideep's caches: 64 entries").
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

# After a parallel region, libgomp's idle workers spin this many rounds before they sleep: about
# a millisecond, against ten times that at the default 300,000. A decode step's parallel ops then
# find the workers spinning through its single-threaded stretches (a sleep there adds a wake-up
# to the next op), and the pause between steps still frees the core for the adapter loaders,
# which the default's longer spin kept off it.
# measured: docs/notes/engine.md, "OpenMP's spin-waits: 30,000 rounds"
SPIN_COUNT = "30000"


def waits_actively() -> bool:
    """Whether the user told OpenMP to spin without end between parallel regions
    (``OMP_WAIT_POLICY=active``): then the cores never idle while the engine decodes."""
    return os.environ.get("OMP_WAIT_POLICY", "").lower() == "active"


# Entries of oneDNN's primitive cache and of ideep's cache (see the module's docstring).
ONEDNN_CACHE_ENTRIES = "64"
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def tune_native_libraries() -> None:
    """Shorten OpenMP's spin-waits and bound oneDNN's caches, where the user did not choose."""
    tune_openmp_waits()
    bound_onednn_caches()


def bound_onednn_caches() -> None:
    """Set the caches' capacity unless the user did; too late (logged) once torch is imported."""
    if "torch" in sys.modules:
        log.debug("torch is already loaded: oneDNN's caches keep their capacity")
        return
    for name in CACHE_VARIABLES:
        os.environ.setdefault(name, ONEDNN_CACHE_ENTRIES)


def _user_chose_waits() -> bool:
    return "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ


def openmp_spin_count() -> str | None:
    """The rounds libgomp's idle workers spin before they sleep in the processes that call
    :func:`tune_openmp_waits` (``worker serve``, ``bench engine``): the user's
    ``GOMP_SPINCOUNT``, else :data:`SPIN_COUNT`; None under the user's ``OMP_WAIT_POLICY``
    alone (libgomp's own count)."""
    if "GOMP_SPINCOUNT" in os.environ:
        return os.environ["GOMP_SPINCOUNT"]
    return None if _user_chose_waits() else SPIN_COUNT


def tune_openmp_waits() -> None:
    """Set ``GOMP_SPINCOUNT`` unless the user did; too late (logged) once torch is imported."""
    if _user_chose_waits():
        return  # the user's choice
    if "torch" in sys.modules:
        log.debug("torch is already loaded: OpenMP keeps its default spin-waits")
        return
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing happens).

    Called once the model is built: loading reads every weight in the checkpoint's dtype, and
    the projections then keep their own copies (prepacked or quantized) and free those reads.
    glibc raises its mmap threshold after each large free, so later allocations come from the
    heap and the freed pages stay resident, a different amount from run to run (measured:
    docs/notes/engine.md, "Freed memory handed back")."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError) as err:  # not glibc (musl has no malloc_trim)
        log.debug("no malloc_trim here: %s", err)


# glibc's mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Allocations up to this size come from the heap, not a mapping of their own: above the largest
# stream message (8 MiB of data, the store's limit) and the gRPC buffers holding one; 32 MiB is
# also as far as glibc's own adjustment would ever raise it on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
RECEIVE_MMAP_THRESHOLD = 32 << 20
# Free memory at the heap's top kept for the next allocations rather than returned: room for a
# few messages in flight on each of the fetch threads.
RECEIVE_TRIM_THRESHOLD = 128 << 20


def keep_freed_buffers() -> bool:
    """Make glibc keep freed message buffers for the next message instead of returning them to
    the system; True if it took the settings (elsewhere than glibc nothing changes: False).

    For a process that receives adapter streams (the worker's fetch process; ``bench transfer``'s
    clients that do what it does). Every message of a stream is received into a buffer of its
    own, gRPC's and then Python's ``bytes``, freed once landed. At glibc's defaults a buffer of
    1 MB is its own mapping, or ends up at the top of the heap and is trimmed, so the next one
    faults in 256 fresh pages, which costs more than the receive itself (measured:
    docs/notes/loading.md, "Freed receive buffers kept"). Called before the process starts
    receiving; the settings also stop glibc's own adjustment of the mmap threshold (mallopt(3)).
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as err:  # not glibc (musl has no mallopt)
        log.debug("no mallopt here: %s", err)
        return False
    took = (mallopt(_M_MMAP_THRESHOLD, RECEIVE_MMAP_THRESHOLD) == 1
            and mallopt(_M_TRIM_THRESHOLD, RECEIVE_TRIM_THRESHOLD) == 1)
    if not took:
        log.warning("glibc refused the receive buffers' malloc settings; streams fault in pages")
    return took
