"""Bring adapters into host memory: reserve their bytes, fetch them from the store, check them
against the base model (rule 6) before anything can copy them into a slot.

With overlap, fetches run on the fetch threads; without it, on the caller's thread. A failed
fetch fails the adapter with its error (rule 5), never the worker. While a fetch runs, the
entry's ``layers_landed`` follows the adapter's leading layers as they land verified (the store
streams them in layer order), and waiters are notified each time it grows.

The loader shares the adapter manager's entries and lock: the manager calls :meth:`ensure`
with its lock free (a fetch may run there), and the loader takes the lock for every change,
notifying the manager's waiters when a fetch ends or an adapter fails.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor

import torch

from lorastream.core.errors import (
    AdapterNotFound,
    CapacityExhausted,
    LorastreamError,
    SourceUnavailable,
)
from lorastream.worker.loading.adapter_weights import adapter_weights
from lorastream.worker.loading.cost_model import AdmissionCostModel
from lorastream.worker.loading.entry import AdapterEntry
from lorastream.worker.loading.fetcher import AdapterFetcher
from lorastream.worker.loading.host_tier import HostTier
from lorastream.worker.loading.landing import host_nbytes
from lorastream.worker.loading.layer_progress import manifest_layers
from lorastream.worker.metrics import WorkerMetrics
from lorastream.worker.model.config import ModelConfig

log = logging.getLogger(__name__)


class HostLoader:
    def __init__(
        self,
        entries: dict[str, AdapterEntry],
        changed: threading.Condition,
        host: HostTier,
        fetcher: AdapterFetcher,
        config: ModelConfig,
        max_rank: int,
        metrics: WorkerMetrics,
        cost_model: AdmissionCostModel,
        pool: Executor | None,
        landed: Callable[[AdapterEntry], object],
        layers_changed: Callable[[AdapterEntry], object] = lambda entry: None,
    ) -> None:
        """``entries`` and ``changed`` (a condition on its lock) are the manager's; ``pool``
        runs the fetches (None: on the caller's thread); ``landed(entry)`` is called, outside
        the lock, when a fetch in the pool lands an adapter a request waits for;
        ``layers_changed(entry)``, with the lock held, when more of its layers landed, when its
        fetch ended and when it failed (layer-ordered admission follows it)."""
        self._entries = entries
        self._changed = changed
        self.host = host
        self.fetcher = fetcher
        self.config = config
        self.max_rank = max_rank
        self.metrics = metrics
        self._cost_model = cost_model
        self._pool = pool
        self._landed = landed
        self._layers_changed = layers_changed
        self._fetches = 0  # store fetches in flight (entries with ``fetching`` set)

    @property
    def fetching(self) -> bool:
        """Whether a store fetch is in flight (read without the lock: a hint for one gap)."""
        return self._fetches > 0

    def ensure(self, entry: AdapterEntry) -> None:
        """Start fetching ``entry`` into host memory unless it is there or on its way (call it
        without the lock: without a pool the fetch runs here)."""
        with self._changed:
            if entry.weights is not None or entry.fetching or entry.error is not None:
                return
            if entry.local_path is not None:
                entry.error = AdapterNotFound(
                    f"adapter {entry.name} was evicted from this worker; load it again"
                )
                return
            need = host_nbytes(entry.manifest)
            if need > self.host.budget:
                entry.error = CapacityExhausted(
                    f"adapter {entry.name} needs {need} bytes of host memory, more than the "
                    f"whole host budget ({self.host.budget}); raise --host-cache-bytes"
                )
                return
            if not self.host.reserve(self._entries.values(), entry, need):
                return  # every byte is held by adapters in use: wait, retried at the next step
            entry.fetching = True
            entry.layers_landed = 0
            self._fetches += 1
            entry.fetch_started = time.perf_counter()
            storage = self.host.storage(entry)
        if self._pool is not None:
            self._pool.submit(self._fetch, entry, storage)
        else:
            self._fetch(entry, storage)

    def wait(self, entry: AdapterEntry, deadline: float, timeout_message: str) -> None:
        """Block until ``entry`` is in host memory: start its fetch, and again whenever the
        manager's condition says a fetch ended or a reference dropped (the budget may have room
        now). Raises the adapter's error, or :class:`SourceUnavailable` at ``deadline``
        (``time.monotonic``). Call it without the lock."""
        while True:
            self.ensure(entry)  # without a pool the fetch runs here
            with self._changed:
                if entry.weights is not None:
                    return
                if entry.error is not None:
                    raise entry.error
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SourceUnavailable(timeout_message)
                self._changed.wait(remaining)

    def fail(self, entry: AdapterEntry, err: LorastreamError) -> None:
        log.warning("adapter %s cannot be loaded: %s", entry.name, err)
        self.metrics.load_failures.inc()
        with self._changed:
            entry.error = err
            self._changed.notify_all()

    def _layers_landed(self, entry: AdapterEntry, count: int) -> None:
        """A fetch's report that ``entry``'s first ``count`` layers landed, verified."""
        with self._changed:
            if entry.fetching and count > entry.layers_landed:
                entry.layers_landed = count
                self._layers_changed(entry)
                self._changed.notify_all()

    def _fetch(self, entry: AdapterEntry, storage: torch.Tensor | None) -> None:
        try:
            started = time.perf_counter()
            buffer = self.fetcher.fetch(
                entry.name, entry.adapter_id, storage,
                on_layers=lambda count: self._layers_landed(entry, count),
            )
            elapsed = time.perf_counter() - started
            self.metrics.fetch_seconds.observe(elapsed)
            self._cost_model.observe_fetch(entry.manifest.total_bytes, elapsed)
            self.metrics.host_landing_seconds.observe(buffer.landing_seconds)
            assert buffer.manifest is not None
            weights = adapter_weights(buffer, self.config, self.max_rank)
            with self._changed:
                entry.weights = weights  # its bytes were reserved when the fetch began
                entry.layers_landed = manifest_layers(buffer.manifest)
        except LorastreamError as err:
            self.fail(entry, err)
        except Exception as err:  # noqa: BLE001 - any failure fails the adapter, never the worker
            log.exception("fetching %s failed", entry.name)
            self.fail(entry, SourceUnavailable(f"fetching adapter {entry.name} failed: {err!r}"))
        finally:
            with self._changed:
                entry.fetching = False
                self._fetches -= 1
                if entry.weights is None:
                    self.host.drop(entry)  # release the reservation (layers_landed: 0)
                self._layers_changed(entry)
                waited_for = entry.refs > 0 and entry.error is None
                self._changed.notify_all()
        if self._pool is not None and waited_for:
            self._landed(entry)  # start the copy into a slot now, not at the next step
