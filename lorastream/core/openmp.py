"""OpenMP settings for the worker's CPU compute, which must be in place before torch loads.

GNU OpenMP (torch's intra-op threading on Linux) reads its environment once, when torch is
imported, so the commands that compute (``worker serve``, ``bench engine``) call
:func:`tune_openmp_waits` first thing.
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


def tune_openmp_waits() -> None:
    """Set ``GOMP_SPINCOUNT`` unless the user did; too late (logged) once torch is imported."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return  # the user's choice
    if "torch" in sys.modules:
        log.debug("torch is already loaded: OpenMP keeps its default spin-waits")
        return
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
