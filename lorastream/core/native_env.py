"""Settings of torch's native libraries for the worker's CPU compute, in place before torch loads,
and :func:`release_freed_memory`, called once the model is built.

GNU OpenMP (torch's intra-op threading on Linux) reads its environment once, when torch is
imported, and oneDNN and ideep read theirs when they first build a primitive, so the commands
that compute (``worker serve``, ``bench engine``) call :func:`tune_native_libraries` first thing:

* OpenMP's spin-waits are shortened (``GOMP_SPINCOUNT``, below);
* oneDNN's primitive cache and ideep's cache of prepared products hold 64 entries instead of
  1,024 (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``).

The caches: the prepacked projections (``model/linear.py``) run on oneDNN, which builds a
primitive (JIT kernel, scratchpad) for each input shape, and ideep keeps one more object per
shape; both are keyed by the row count, which a worker takes anywhere from 1 to its token
budget. At 1,024 entries each they hold hundreds of MB once filled, and a 10-minute soak grew
the worker's RSS 11.4% over its post-warm-up level before they were full (issue 22). Measured
on the default model's projection shapes (30 layers, row counts 1..133 in random order, three
rounds): RSS +258 MB at the defaults, +143 MB with only oneDNN's cache at 8 (so ideep's counts
too), +18 MB with both at 64, and the same time per round (24 s): building a primitive costs
little next to the 30 layers that use it. One step needs ~6 shapes (its row count, the lm_head's
rows), so 64 keeps a few steps' worth.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

# After a parallel region, libgomp's idle workers spin this many rounds before they sleep:
# ~0.1 ms instead of the default 300,000 rounds (10+ ms on current x86). Back-to-back ops of a
# step still find the workers spinning; a gap between steps or a single-threaded stretch of
# Python frees the core for the adapter loaders and, on a shared box, the store. Measured with
# `lorastream bench serve` (store, worker and loaders on 2 cores): at the default, loads that ran
# during decoding took 1,055 ms instead of 680 and overlapped loading lost its TTFT gain.
SPIN_COUNT = "3000"


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


def tune_openmp_waits() -> None:
    """Set ``GOMP_SPINCOUNT`` unless the user did; too late (logged) once torch is imported."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
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
    heap and the freed pages stay resident: measured on the default model with
    ``--quantization int8``, the model's resident bytes were 231-485 MB from run to run without
    a trim and 146 MB with it (``bench engine --quantization``, which measures them so)."""
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
