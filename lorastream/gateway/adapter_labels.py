"""Bounded per-adapter metric labels: the N busiest models by name, every other one as ``other``.

With thousands of adapters a ``model`` label per adapter would make thousands of series per
histogram. :class:`AdapterLabels` keeps at most N names labelled (``--metrics-adapter-labels``)
and finds the busiest with bounded memory, by the Space-Saving algorithm (Metwally, Agrawal and
El Abbadi, 2005):

Semantics::

    counts, errors: at most `capacity` (8 N, at least 64) names -> estimated requests, and how
                    much of the estimate may be inherited
    observe(m):
        if m in counts: counts[m] += 1
        elif len(counts) < capacity: counts[m], errors[m] = 1, 0
        else: k = argmin(counts); c = counts.pop(k); errors.pop(k)
              counts[m], errors[m] = c + 1, c                 # m inherits k's count
        every `halve_every` observations: counts, errors //= 2   (recent traffic weighs more)
        sure(x) = counts[x] - errors[x]                          # requests x surely had
        if m not labelled:
            if fewer than N labelled: label m
            elif sure(m) > 5/4 * sure(weakest labelled): unlabel weakest (drop its series),
                                                         label m
    label(m) = m if labelled else "other"

Space-Saving never under-counts and over-counts by at most total / capacity, so a model with
more than a 1/capacity share of the requests stays counted; competing for a label on the sure
count (``sure(x)`` never exceeds x's real count) keeps a rare model that just inherited a large
count from taking a label. The 5/4 margin keeps two models of about equal traffic from swapping
the label back and forth; the halving lets a model that went quiet give its label up to one that
got busy. Memory: ``capacity`` counters; an observation costs O(1), or O(capacity) when a new
name replaces the least counted one or competes for a label.

Example (N = 1): requests a a b -> a labelled; then b b b -> sure counts a 2, b 4 > 5/4 * 2: b
takes the label, a's series are dropped and a counts as ``other`` from then on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

OTHER = "other"
_MIN_CAPACITY = 64
_COUNTERS_PER_LABEL = 8
_HALVE_EVERY_PER_COUNTER = 64  # halve all counts every 64 * capacity observations


class AdapterLabels:
    """Which models get a label of their own; ``on_drop(name)`` when one loses its label."""

    def __init__(self, n: int, on_drop: Callable[[str], None] = lambda _name: None) -> None:
        if n < 0:
            raise ValueError(f"the number of adapter labels must be >= 0, got {n}")
        self.n = n
        self.capacity = max(_COUNTERS_PER_LABEL * n, _MIN_CAPACITY)
        self.halve_every = _HALVE_EVERY_PER_COUNTER * self.capacity
        self._counts: dict[str, int] = {}
        self._errors: dict[str, int] = {}
        self._labelled: set[str] = set()
        self._seen = 0
        self._on_drop = on_drop
        self._lock = threading.Lock()

    @property
    def labelled(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._labelled)

    def label(self, model: str) -> str:
        """``model`` if it has a label of its own, else ``other``."""
        return model if model in self._labelled else OTHER

    def count(self, model: str) -> int:
        """The (recent) requests ``model`` surely had; 0 when it is not counted."""
        with self._lock:
            return self._sure(model)

    def _sure(self, model: str) -> int:
        return self._counts.get(model, 0) - self._errors.get(model, 0)

    def observe(self, model: str) -> str:
        """Count one request for ``model``; returns its label."""
        if self.n == 0:
            return OTHER
        dropped: str | None = None
        with self._lock:
            self._count(model)
            if model not in self._labelled:
                if len(self._labelled) < self.n:
                    self._labelled.add(model)
                else:
                    weakest = min(self._labelled, key=self._sure)
                    if self._sure(model) * 4 > self._sure(weakest) * 5:
                        self._labelled.discard(weakest)
                        self._labelled.add(model)
                        dropped = weakest
            label = self.label(model)
        if dropped is not None:
            self._on_drop(dropped)
        return label

    def _count(self, model: str) -> None:
        counts, errors = self._counts, self._errors
        if model in counts:
            counts[model] += 1
        elif len(counts) < self.capacity:
            counts[model], errors[model] = 1, 0
        else:
            least = min(counts, key=counts.__getitem__)
            inherited = counts.pop(least)
            del errors[least]
            counts[model], errors[model] = inherited + 1, inherited
        self._seen += 1
        if self._seen % self.halve_every == 0:
            for name in counts:
                counts[name] //= 2
                errors[name] //= 2
