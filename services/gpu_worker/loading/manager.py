"""The worker's adapters across tiers: store -> host buffer -> device slot.

Adapters are keyed by content id (DESIGN "Identity"); names map to ids. Each adapter counts the
queued and running requests that need it (``refs``); only unpinned adapters at zero references
are evicted, from the host tier (LRU within ``host_budget``) or from a slot (LRU).

Thread model: gRPC threads resolve names and take references, fetch threads land host buffers
(or wait while the fetch process lands them), the engine loop places adapters into slots and
releases references. One lock guards the state; no fetch, copy or store call runs under it.

The rules of DESIGN.md kept here:
1. a slot is usable only once its load event completed (:meth:`ready`, a non-blocking query);
2. a slot is overwritten only after the last step that read it: the copy is submitted to the load
   stream ``after`` that step's compute event (:meth:`mark_read` records it);
4. references, not guesses, decide eviction;
5. an adapter that cannot be loaded fails its requests with its error (:attr:`AdapterEntry.error`);
6. an adapter is checked against the base model on the host (``adapter_weights``) before a slot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lorastream.core.errors import (
    AdapterNotFound,
    CapacityExhausted,
    InvalidArgument,
    LorastreamError,
    SourceUnavailable,
)
from lorastream.worker.device.device import COMPLETED, Device, Event, loader_thread_init
from lorastream.worker.loading.adapter_weights import AdapterWeights, adapter_weights, check_fits
from lorastream.worker.loading.cost_model import AdmissionCostModel
from lorastream.worker.loading.entry import AdapterEntry, Residency
from lorastream.worker.loading.fetcher import AdapterFetcher
from lorastream.worker.loading.host_tier import HostTier
from lorastream.worker.loading.landing import host_nbytes
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.metrics import WorkerMetrics
from lorastream.worker.model.config import LlamaConfig

log = logging.getLogger(__name__)


class AdapterManager:
    def __init__(
        self,
        config: LlamaConfig,
        slots: LoraSlots,
        device: Device,
        fetcher: AdapterFetcher,
        host_budget: int,
        *,
        overlap: bool = True,
        fetch_threads: int = 1,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.config = config
        self.slots = slots
        self.device = device
        self.fetcher = fetcher
        self.host_budget = host_budget
        self.overlap = overlap
        self.metrics = metrics or WorkerMetrics()
        self.host = HostTier(device, host_budget, self.metrics, fetcher.landing_memory)
        self.cost_model = AdmissionCostModel()
        self._lock = threading.RLock()
        self._entries: dict[str, AdapterEntry] = {}  # adapter_id -> entry
        self._names: dict[str, str] = {}  # name -> adapter_id
        self._slot_read: list[Event] = [COMPLETED] * slots.num_slots  # rule 2
        self._fetches = 0  # store fetches in flight (entries with ``fetching`` set)
        self._pool = ThreadPoolExecutor(
            fetch_threads,
            thread_name_prefix="adapter-fetch",
            initializer=loader_thread_init,
            initargs=(device.loader_priority,),
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.fetcher.close()

    # -- names ------------------------------------------------------------------------------
    def resolve(self, name: str) -> AdapterEntry:
        """The entry for ``name``: its current content per the store, or a local registration.

        Called from request threads. The store is asked every time, so a name re-registered
        with new weights maps to its new content id; when the store cannot be reached, an
        adapter this worker already holds keeps serving (logged).
        """
        with self._lock:
            known = self._entries.get(self._names.get(name, ""))
            if known is not None and (known.local_path is not None or known.pinned):
                return known
        if not self.fetcher.has_store:
            if known is not None:
                return known
            raise AdapterNotFound(
                f"unknown model {name!r}: not the base model and not an adapter loaded on this "
                "worker (the worker has no --store to look it up)"
            )
        try:
            manifest = self.fetcher.describe(name)
        except SourceUnavailable:
            if known is None:
                raise
            log.warning("store unreachable; serving %s from this worker's copy", name)
            return known
        check_fits(manifest, self.config, self.slots.max_rank)
        with self._lock:
            entry = self._entries.get(manifest.adapter_id)
            if entry is None:
                entry = AdapterEntry(manifest.adapter_id, name, manifest)
                self._entries[manifest.adapter_id] = entry
            self._names[name] = manifest.adapter_id
            return entry

    def register_local(self, name: str, path: Path, pin: bool) -> AdapterEntry:
        """Read, check and keep a local PEFT directory under ``name`` (blocking)."""
        buffer = self.fetcher.read_local(name, path)
        assert buffer.manifest is not None
        weights = adapter_weights(buffer, self.config, self.slots.max_rank)
        need = host_nbytes(buffer.manifest)
        with self._lock:
            entry = self._entries.get(weights.adapter_id)
            if entry is None:
                entry = AdapterEntry(weights.adapter_id, name, buffer.manifest, local_path=path)
            if entry.weights is None:
                if need > self.host_budget or not self.host.reserve(
                    self._entries.values(), entry, need, arena=False
                ):
                    raise CapacityExhausted(
                        f"adapter {name} needs {need} bytes of host memory; the host budget "
                        f"({self.host_budget}) is held by adapters in use or pinned: retry later "
                        "or raise --host-cache-bytes"
                    )
                entry.weights = weights
            self._entries[weights.adapter_id] = entry
            entry.local_path = path
            entry.pinned = entry.pinned or pin
            self._names[name] = weights.adapter_id
            return entry

    # -- references ---------------------------------------------------------------------------
    def acquire(self, entry: AdapterEntry) -> None:
        with self._lock:
            if entry.refs == 0 and entry.error is not None:
                entry.error = None  # a new request retries a failed load
            entry.refs += 1
            entry.last_used = time.monotonic()
            m = self.metrics
            if entry.residency is Residency.DEVICE:
                m.hits.labels("device").inc()
            else:
                m.misses.labels("device").inc()
                (m.hits if entry.weights is not None else m.misses).labels("host").inc()

    def release(self, entry: AdapterEntry) -> None:
        with self._lock:
            entry.refs -= 1
            assert entry.refs >= 0, f"reference count of {entry.name} went negative"
            entry.last_used = time.monotonic()

    # -- tiers --------------------------------------------------------------------------------
    def ensure_host(self, entry: AdapterEntry) -> None:
        """Start fetching ``entry`` into host memory unless it is there or on its way.

        Without overlap the fetch runs here, in the caller's thread.
        """
        with self._lock:
            if entry.weights is not None or entry.fetching or entry.error is not None:
                return
            if entry.local_path is not None:
                entry.error = AdapterNotFound(
                    f"adapter {entry.name} was evicted from this worker; load it again"
                )
                return
            need = host_nbytes(entry.manifest)
            if need > self.host_budget:
                entry.error = CapacityExhausted(
                    f"adapter {entry.name} needs {need} bytes of host memory, more than the "
                    f"whole host budget ({self.host_budget}); raise --host-cache-bytes"
                )
                return
            if not self.host.reserve(self._entries.values(), entry, need):
                return  # every byte is held by adapters in use: wait, retried at the next step
            entry.fetching = True
            self._fetches += 1
            entry.fetch_started = time.perf_counter()
            storage = self.host.storage(entry)
        if self.overlap:
            self._pool.submit(self._fetch, entry, storage)
        else:
            self._fetch(entry, storage)

    def _fetch(self, entry: AdapterEntry, storage: torch.Tensor | None) -> None:
        try:
            started = time.perf_counter()
            buffer = self.fetcher.fetch(entry.name, entry.adapter_id, storage)
            elapsed = time.perf_counter() - started
            self.metrics.fetch_seconds.observe(elapsed)
            self.cost_model.observe_fetch(entry.manifest.total_bytes, elapsed)
            self.metrics.host_landing_seconds.observe(buffer.landing_seconds)
            assert buffer.manifest is not None
            weights = adapter_weights(buffer, self.config, self.slots.max_rank)
            with self._lock:
                entry.weights = weights  # its bytes were reserved when the fetch began
        except LorastreamError as err:
            self._fail(entry, err)
        except Exception as err:  # noqa: BLE001 - any failure fails the adapter, never the worker
            log.exception("fetching %s failed", entry.name)
            self._fail(entry, SourceUnavailable(f"fetching adapter {entry.name} failed: {err!r}"))
        finally:
            with self._lock:
                entry.fetching = False
                self._fetches -= 1
                if entry.weights is None:
                    self.host.drop(entry)  # release the reservation
                waited_for = entry.refs > 0 and entry.error is None
        if self.overlap and waited_for:
            self.place(entry)  # start the copy into a slot now, not at the next step

    def _fail(self, entry: AdapterEntry, err: LorastreamError) -> None:
        log.warning("adapter %s cannot be loaded: %s", entry.name, err)
        self.metrics.load_failures.inc()
        with self._lock:
            entry.error = err

    def ready(self, entry: AdapterEntry) -> bool:
        """True when ``entry`` sits in a slot whose copy completed (never blocks)."""
        with self._lock:
            return entry.slot is not None and (entry.slot_event is None or entry.slot_event.query())

    def place(self, entry: AdapterEntry) -> bool:
        """Make progress towards ``entry`` being in a slot; True once it is ready.

        Starts the host fetch if needed, then takes a free slot or the least recently used idle
        one and submits the copy on the load stream after the last step that read that slot.
        Without overlap it waits for the fetch and the copy.
        """
        if self.ready(entry):
            return True
        self.ensure_host(entry)
        with self._lock:
            if entry.error is not None or entry.weights is None or entry.slot is not None:
                event = entry.slot_event
            else:
                slot = self._free_slot()
                if slot is None:
                    return False
                weights = entry.weights
                entry.slot = slot
                entry.copy_started = time.perf_counter()
                self.slots.table[slot].adapter_id = entry.adapter_id  # claimed
                event = self.device.load_stream.submit(
                    self._copy_ops(slot, weights), after=self._slot_read[slot]
                )
                entry.slot_event = event
        if event is not None and not self.overlap:
            event.wait()
        if event is not None and event.query() and getattr(event, "error", None) is not None:
            self._fail(entry, SourceUnavailable(f"copying {entry.name} to the device failed"))
            with self._lock:
                self._evict_slot(entry)
        return self.ready(entry) and entry.error is None

    def _copy_ops(self, slot: int, weights: AdapterWeights) -> list[Callable[[], None]]:
        """The load-stream job: zero ``slot`` and copy the adapter in, timed from its first
        operation to its last (on the CPU that includes the steps between its turns)."""
        started = 0.0

        def start() -> None:
            nonlocal started
            started = time.perf_counter()

        def observe() -> None:
            elapsed = time.perf_counter() - started
            self.metrics.device_copy_seconds.observe(elapsed)
            self.cost_model.observe_copy(weights.nbytes, elapsed)

        ops = self.slots.write_ops(
            slot, weights.adapter_id, weights.rank, weights.scaling, list(weights.blocks)
        )
        return [start, *ops, observe]

    def _free_slot(self) -> int | None:
        """An empty slot, or the LRU slot of an idle unpinned adapter (evicted) (lock held)."""
        occupants = {e.slot: e for e in self._entries.values() if e.slot is not None}
        for slot in range(self.slots.num_slots):
            if slot not in occupants:
                return slot
        idle = [e for e in occupants.values() if e.refs == 0 and not e.pinned]
        if not idle:
            return None
        victim = min(idle, key=lambda e: e.last_used)
        slot = victim.slot
        log.debug("evicting %s from slot %s", victim.name, slot)
        self.metrics.evictions.labels("device").inc()
        self._evict_slot(victim)
        return slot

    def _evict_slot(self, entry: AdapterEntry) -> None:
        if entry.slot is not None:
            self.slots.clear(entry.slot)
        entry.slot, entry.slot_event = None, None

    def eta(self, entry: AdapterEntry) -> float | None:
        """Expected seconds until ``entry`` is usable in a slot; None when no load is under way."""
        now, nbytes = time.perf_counter(), entry.manifest.total_bytes
        with self._lock:
            if entry.fetching:
                return self.cost_model.eta(nbytes, entry.fetch_started, True, now)
            if entry.slot is not None and entry.slot_event is not None:
                if entry.slot_event.query():
                    return 0.0
                return self.cost_model.eta(nbytes, entry.copy_started, False, now)
        return None

    def mark_read(self, slot_ids: set[int], event: Event) -> None:
        """Record that the step behind ``event`` read ``slot_ids`` (DESIGN rule 2)."""
        with self._lock:
            for slot in slot_ids:
                self._slot_read[slot] = event

    # -- operator calls -------------------------------------------------------------------------
    def unload(self, name: str) -> None:
        with self._lock:
            adapter_id = self._names.pop(name, None)
            entry = self._entries.get(adapter_id or "")
            if entry is None:
                raise AdapterNotFound(f"adapter {name!r} is not loaded on this worker")
            if entry.refs:
                self._names[name] = entry.adapter_id
                raise InvalidArgument(
                    f"adapter {name} is used by {entry.refs} queued or running requests; retry "
                    "once they finish"
                )
            if entry.copying or entry.fetching:
                self._names[name] = entry.adapter_id
                raise InvalidArgument(
                    f"adapter {name} is being loaded on this worker; retry once it is resident"
                )
            self._evict_slot(entry)
            self.host.drop(entry)
            entry.pinned = False
            if entry.adapter_id not in self._names.values():
                del self._entries[entry.adapter_id]

    def entries(self) -> list[AdapterEntry]:
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.name)

    def names_of(self, entry: AdapterEntry) -> list[str]:
        with self._lock:
            return sorted(n for n, aid in self._names.items() if aid == entry.adapter_id)

    @property
    def host_bytes_used(self) -> int:
        with self._lock:
            return sum(e.host_bytes for e in self._entries.values())

    @property
    def slots_used(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.slot is not None)

    def resident(self) -> tuple[dict[str, int], dict[str, int]]:
        """(tier -> adapters, tier -> bytes) for the host and device tiers."""
        with self._lock:
            entries = list(self._entries.values())
        on_host = [e for e in entries if e.weights is not None]
        on_device = [e for e in entries if e.residency is Residency.DEVICE]
        return (
            {"host": len(on_host), "device": len(on_device)},
            {"host": sum(e.host_bytes for e in on_host),
             "device": sum(e.manifest.total_bytes for e in on_device)},
        )

    @property
    def fetching(self) -> bool:
        """Whether a store fetch is in flight (read without the lock: a hint for one gap)."""
        return self._fetches > 0

    @property
    def loading(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.residency is Residency.LOADING)
