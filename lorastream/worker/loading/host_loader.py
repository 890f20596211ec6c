"""Bring adapters into host memory: reserve their bytes, fetch them from the store, check them
against the base model (rule 6) before anything can copy them into a slot.

A load is three calls, which the adapter manager makes in order (``AdapterManager._fetch``):
:meth:`HostLoader.begin` (with the manager's lock held: the checks, the reservation),
:meth:`HostLoader.fetch` (without it, on a fetch thread or the caller's: the store stream and the
check), :meth:`HostLoader.end` (with the lock again: the weights, or the error, recorded). A failed
fetch fails the adapter with its error (rule 5), never the worker. While a fetch runs, the fetcher
reports the adapter's leading layers as they land verified (the store streams them in layer
order); the manager records them on the entry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from lorastream.core.errors import (
    AdapterNotFound,
    CapacityExhausted,
    LorastreamError,
    SourceUnavailable,
)
from lorastream.core.manifest import AdapterManifest
from lorastream.worker.loading.adapter_weights import AdapterWeights, adapter_weights
from lorastream.worker.loading.cost_model import AdmissionCostModel
from lorastream.worker.loading.entry import AdapterEntry
from lorastream.worker.loading.fetcher import AdapterFetcher
from lorastream.worker.loading.host_tier import HostTier
from lorastream.worker.loading.landing import host_nbytes
from lorastream.worker.loading.layer_progress import LayersCallback, manifest_layers
from lorastream.worker.metrics import WorkerMetrics
from lorastream.worker.model.config import ModelConfig

log = logging.getLogger(__name__)


class HostLoader:
    def __init__(
        self,
        host: HostTier,
        fetcher: AdapterFetcher,
        config: ModelConfig,
        max_rank: int,
        metrics: WorkerMetrics,
        cost_model: AdmissionCostModel,
    ) -> None:
        self.host = host
        self.fetcher = fetcher
        self.config = config
        self.max_rank = max_rank
        self.metrics = metrics
        self._cost_model = cost_model
        self._fetches = 0  # store fetches in flight (entries with ``fetching`` set)

    @property
    def fetching(self) -> bool:
        """Whether a store fetch is in flight (read without the lock: a hint for one gap)."""
        return self._fetches > 0

    def begin(self, entries: Iterable[AdapterEntry], entry: AdapterEntry) -> bool:
        """Reserve ``entry``'s host bytes (evicting idle ones among ``entries``) and mark its
        fetch begun; True when the caller is to :meth:`fetch` it now. False when it is in host
        memory, on its way, failed (now or before), or waits for room (retried at the next
        step). Call it with the manager's lock held."""
        if entry.weights is not None or entry.fetching or entry.error is not None:
            return False
        if entry.local_path is not None:
            entry.fail(AdapterNotFound(
                f"adapter {entry.name} was evicted from this worker; load it again"
            ))
            return False
        need = host_nbytes(entry.manifest)
        if need > self.host.budget:
            entry.fail(CapacityExhausted(
                f"adapter {entry.name} needs {need} bytes of host memory, more than the "
                f"whole host budget ({self.host.budget}); raise --host-cache-bytes"
            ))
            return False
        if not self.host.reserve(entries, entry, need):
            return False  # every byte is held by adapters in use: wait, retried at the next step
        entry.begin_fetch()
        self._fetches += 1
        return True

    def read_local(self, name: str, path: Path) -> tuple[AdapterWeights, AdapterManifest]:
        """Read and check the local PEFT directory ``path`` (blocking; without the lock)."""
        buffer = self.fetcher.read_local(name, path)
        assert buffer.manifest is not None
        return adapter_weights(buffer, self.config, self.max_rank), buffer.manifest

    def keep_local(self, entries: Iterable[AdapterEntry], entry: AdapterEntry,
                   weights: AdapterWeights) -> None:
        """Keep ``weights``, read from a local directory, as ``entry``'s host copy (unless it
        has one), reserving their bytes outside the arena. Raises CapacityExhausted when the
        adapters in use leave no room. Call it with the manager's lock held."""
        if entry.weights is not None:
            return
        assert entry.manifest is not None
        need = host_nbytes(entry.manifest)
        if need > self.host.budget or not self.host.reserve(entries, entry, need, arena=False):
            raise CapacityExhausted(
                f"adapter {entry.name} needs {need} bytes of host memory; the host budget "
                f"({self.host.budget}) is held by adapters in use or pinned: retry later "
                "or raise --host-cache-bytes"
            )
        entry.land(weights, manifest_layers(entry.manifest))

    def fetch(self, entry: AdapterEntry, storage: torch.Tensor | None,
              on_layers: LayersCallback) -> AdapterWeights:
        """Stream ``entry`` from the store into ``storage`` (its arena range; None: allocate)
        and check it against the base model; ``on_layers(count)`` hears each time more of its
        leading layers landed verified. Raises the failure as a :class:`LorastreamError`.
        Call it without the lock."""
        try:
            started = time.perf_counter()
            buffer = self.fetcher.fetch(entry.name, entry.adapter_id, storage, on_layers)
            elapsed = time.perf_counter() - started
            self.metrics.fetch_seconds.observe(elapsed)
            self._cost_model.observe_fetch(entry.manifest.total_bytes, elapsed)
            self.metrics.host_landing_seconds.observe(buffer.landing_seconds)
            assert buffer.manifest is not None
            return adapter_weights(buffer, self.config, self.max_rank)
        except LorastreamError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure fails the adapter, never the worker
            log.exception("fetching %s failed", entry.name)
            raise SourceUnavailable(f"fetching adapter {entry.name} failed: {err!r}") from err

    def end(self, entry: AdapterEntry, landed: AdapterWeights | LorastreamError) -> None:
        """Record the end of ``entry``'s fetch: its checked weights (their bytes were reserved
        when the fetch began), or its error (the reservation is released). Call it with the
        manager's lock held."""
        if isinstance(landed, LorastreamError):
            self.fail(entry, landed)
        else:
            entry.land(landed, manifest_layers(entry.manifest))
        entry.end_fetch()
        self._fetches -= 1
        if entry.weights is None:
            self.host.drop(entry)  # release the reservation (layers_landed: 0)

    def fail(self, entry: AdapterEntry, err: LorastreamError) -> None:
        """``entry`` cannot be loaded: its requests fail with ``err`` (rule 5). Call it with
        the manager's lock held."""
        log.warning("adapter %s cannot be loaded: %s", entry.name, err)
        self.metrics.load_failures.inc()
        entry.fail(err)
