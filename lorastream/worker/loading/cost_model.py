"""When to hold new prefills for a load about to land (docs/design.md, "Scheduling around loads").

Admitting a ready request now and the loading one later costs two prefill steps; waiting for the
load and prefilling both together costs one step plus the wait. With a step costing
``fixed + per_token * tokens`` (fitted from the steps the engine ran), holding saves ``fixed``
and costs the ready requests up to ``eta`` of extra latency. So new prefills are held when

    eta(load) < fixed          (the wait is cheaper than the extra step it avoids)

and never for longer than ``max_hold_s``; running sequences keep decoding meanwhile (a held
step is a decode-only step). ``eta`` is the load's expected remaining time from the fetch and
copy rates observed so far. Example: steps of 40 ms fixed + 0.5 ms/token; a host -> device copy
expected to end in 3 ms -> hold; a store fetch expected to take 300 ms -> admit now.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

WINDOW = 64  # steps remembered for the fit


class AdmissionCostModel:
    def __init__(self, max_hold_s: float = 0.05) -> None:
        self.max_hold_s = max_hold_s
        self._steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (tokens, seconds)
        self._fetch_bytes_per_s: float | None = None
        self._copy_bytes_per_s: float | None = None
        self._holding_since: float | None = None

    # -- observations -------------------------------------------------------------------------
    def observe_step(self, tokens: int, seconds: float) -> None:
        self._steps.append((tokens, seconds))

    def observe_fetch(self, nbytes: int, seconds: float) -> None:
        self._fetch_bytes_per_s = _ewma(self._fetch_bytes_per_s, nbytes / max(seconds, 1e-6))

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        self._copy_bytes_per_s = _ewma(self._copy_bytes_per_s, nbytes / max(seconds, 1e-6))

    # -- estimates ----------------------------------------------------------------------------
    def step_cost(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before enough varied steps were seen."""
        if len(self._steps) < 8:
            return None
        tokens = np.array([t for t, _ in self._steps], dtype=np.float64)
        seconds = np.array([s for _, s in self._steps], dtype=np.float64)
        if np.ptp(tokens) == 0:
            return None
        per_token, fixed = np.polyfit(tokens, seconds, 1)
        return max(float(fixed), 0.0), max(float(per_token), 0.0)

    def eta(self, nbytes: int, started: float, fetching: bool, now: float) -> float | None:
        """Expected seconds until a load of ``nbytes`` that began at ``started`` lands."""
        rate = self._fetch_bytes_per_s if fetching else self._copy_bytes_per_s
        if rate is None:
            return None
        copy = nbytes / self._copy_bytes_per_s if (fetching and self._copy_bytes_per_s) else 0.0
        return max(nbytes / rate + copy - (now - started), 0.0)

    # -- the decision -------------------------------------------------------------------------
    def should_hold(self, etas: list[float | None], now: float | None = None) -> bool:
        """Hold new prefills this step? ``etas``: the loads the next waiting requests need."""
        now = time.monotonic() if now is None else now
        cost = self.step_cost()
        known = [e for e in etas if e is not None]
        if cost is None or not known or min(known) >= cost[0]:
            self._holding_since = None
            return False
        if self._holding_since is None:
            self._holding_since = now
        if now - self._holding_since > self.max_hold_s:
            return False  # waited long enough: admit what is ready
        return True

    def released(self) -> None:
        """The held requests were admitted: the next hold starts afresh."""
        self._holding_since = None


def _ewma(previous: float | None, value: float, weight: float = 0.3) -> float:
    return value if previous is None else (1 - weight) * previous + weight * value
