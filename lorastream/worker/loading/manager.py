"""The worker's adapters across tiers: store -> host buffer -> device slot.

Adapters are keyed by content id (docs/design.md, "Identity"); names map to ids. The manager owns
every adapter's state. The rest of the worker holds only adapter ids (a name is resolved to its id
once, when the request arrives, as in SGLang's lora registry) and asks through these calls:

- request threads: :meth:`resolve` a name (:meth:`resolve_mix` a weighted mix's),
  :meth:`acquire` a reference for a queued request (with overlap, its fetch starts there),
  which the engine gives back (:meth:`release`) when the request ends;
- the scheduler: :meth:`place` (admission; :meth:`place_all` for a mix's components),
  :meth:`prefetch`, :meth:`hold_for_loads`, :meth:`ready`;
- the engine, once per step (as vLLM's ``set_active_adapters``): :meth:`prepare_step` gives the
  step its slots and the copies to wait on, :meth:`mark_read` records its compute event,
  :meth:`observe_step` its cost;
- the engine's layered prefills, only with ``layered`` (``--layered-admission``; the slots'
  side is ``layered.py``): :meth:`place_layered`, :meth:`layers_ready`, :meth:`landing_step`;
- operator threads (below): :meth:`load` (blocking: it waits on the
  fetch's end and the copy's event), :meth:`unload`, :meth:`status`, :meth:`statuses`,
  :meth:`usage`.

Each adapter counts the queued and running requests that need it (references); only unpinned
adapters at zero references are evicted, from the host tier (LRU within ``host_budget``,
``host.py``) or from a slot (LRU, ``device_tier.py``).

Thread model: request threads resolve names and take references, fetch threads land host buffers
(or wait while the fetch process lands them), the engine loop places adapters into slots and
releases references, operator threads wait for loads. One lock guards the state; a condition on
it wakes the waiters when a fetch ends or a reference drops. No fetch, copy or store call runs
under it.

Owners: ``AdapterRecords`` holds the entries and their names (the name resolver uses its
methods), an ``AdapterEntry`` writes its own fields, ``LoraSlots`` its table. A load reads top to
bottom: :meth:`_place` -> :meth:`_ensure` (``HostLoader.begin``) -> :meth:`_fetch`
(``HostLoader.fetch``, ``.end``) -> ``DeviceTier.claim``; no collaborator calls back.

The rules of docs/design.md kept here (1 and 2 in ``device_tier.py``):
4. references, not guesses, decide eviction;
5. an adapter that cannot be loaded fails its requests with its error (:meth:`place` raises it);
6. an adapter is checked against the base model on the host (``adapter_weights``) before a slot.

Operator calls (:meth:`AdapterManager.load`, :meth:`AdapterManager.unload`, the status reads):
an operator thread (a ``LoadAdapter`` RPC, ``lorastream up``'s registrations, a test) asks for an
adapter by name and blocks until it is in host memory and, when a slot is free, on the device:
it waits on the fetch's end and on the copy's event, never polls. The reads answer from the
records.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence, Set
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from lorastream.core.adapter_mix import MixSpec, check_mix, unmixable
from lorastream.core.errors import (
    AdapterNotFound,
    InvalidAdapter,
    InvalidArgument,
    LorastreamError,
    SourceUnavailable,
)
from lorastream.core.generation import AdapterStatus
from lorastream.worker.device.cpu.threads import loader_thread_init
from lorastream.worker.device.device import Device, Event
from lorastream.worker.loading.adapter import (
    AdapterEntry,
    AdapterSnapshot,
    AdapterWeights,
    TierUsage,
    adapter_status,
)
from lorastream.worker.loading.device_tier import AdmissionCostModel, DeviceTier, StepAdapters
from lorastream.worker.loading.fetch import AdapterFetcher, HostLoader
from lorastream.worker.loading.host import HostTier
from lorastream.worker.loading.layered import LayeredSlots, landing_weights
from lorastream.worker.loading.names import AdapterRecords, NameResolver, StoreCatalogue
from lorastream.worker.loading.tokenizers import AdapterTokenizer, AdapterTokenizers
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.metrics import WorkerMetrics
from lorastream.worker.model.config import ModelConfig

log = logging.getLogger(__name__)


class AdapterManager:
    def __init__(
        self,
        config: ModelConfig,
        slots: LoraSlots,
        device: Device,
        fetcher: AdapterFetcher,
        host_budget: int,
        *,
        overlap: bool = True,
        layered: bool = False,
        fetch_threads: int = 1,
        metrics: WorkerMetrics | None = None,
        tokenizers: int,
    ) -> None:
        """``layered``: layer-ordered admission (``--layered-admission``; with ``overlap``
        only): slots filled layer by layer for requests admitted while their adapter lands.
        ``tokenizers``: how many adapters' own tokenizers stay loaded
        (``--adapter-tokenizer-cache``)."""
        self.config = config
        self.slots = slots
        self.fetcher = fetcher
        self.host_budget = host_budget
        self.overlap = overlap
        self.metrics = metrics or WorkerMetrics()
        self.host = HostTier(device, host_budget, self.metrics, fetcher.landing_memory)
        self._cost_model = AdmissionCostModel()
        self._device = device
        self._device_tier = DeviceTier(slots, device, self.metrics, self._cost_model)
        self._layered = LayeredSlots(self._device_tier) if layered and overlap else None
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # a fetch ended, a reference dropped
        self._records = AdapterRecords(self._lock)
        self._pool = ThreadPoolExecutor(
            fetch_threads,
            thread_name_prefix="adapter-fetch",
            initializer=loader_thread_init,
            initargs=(device.loader_priority,),
        )
        self._tokenizers = AdapterTokenizers(fetcher.client, tokenizers)
        self._resolver = NameResolver(self._records, fetcher, config, slots.max_rank,
                                      slots.vocab_budget)
        self._loader = HostLoader(
            self.host, fetcher, config, slots.max_rank, self.metrics, self._cost_model,
            slots.vocab_budget,
        )

    def close(self) -> None:
        self._resolver.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.fetcher.close()

    # -- names ------------------------------------------------------------------------------
    def resolve(self, name: str) -> str:
        """The content id ``name`` (or ``name@<content-id prefix>``) stands for: a local
        registration, else the store's per its watched catalogue (``names.py``): no store call
        for a resident adapter, and resident adapters keep serving while the store is down.
        Called from request threads; a request that finds the adapter off the device has its
        wait timed from here (``load_timeline.py``)."""
        began = time.perf_counter()
        entry = self._resolver.resolve(name)
        with self._lock:
            if not self._device_tier.ready(entry):
                entry.time_load(began)
        return entry.adapter_id

    def resolve_mix(self, components: MixSpec, limit: int) -> MixSpec:
        """A weighted mix's (content id, weight) per component (``core/adapter_mix.py``): the
        mix checked (at most ``limit`` components), each name resolved (AdapterNotFound for an
        unknown one), a kind that cannot be mixed refused naming the adapter, and names of the
        same content summed (the delta is linear in the weights)."""
        merged: dict[str, float] = {}
        for name, weight in check_mix(components, limit):
            adapter_id = self.resolve(name)
            with self._lock:
                entry = self._records.get(adapter_id)
                manifest = None if entry is None else entry.manifest
            if manifest is None:
                raise AdapterNotFound(f"adapter {name!r} was unloaded as the request arrived")
            why = unmixable(manifest)
            if why is not None:
                raise InvalidArgument(
                    f"adapter {name!r} cannot be part of a weighted mix: {why}; request it alone"
                )
            merged[adapter_id] = merged.get(adapter_id, 0.0) + weight
        return tuple(merged.items())

    def invocation_tokens(self, adapter_id: str) -> tuple[int, ...]:
        """An activated LoRA's invocation tokens (PEFT's ``alora_invocation_tokens``), () for a
        plain LoRA. Called from request threads, after :meth:`resolve`."""
        with self._lock:
            return self._entry(adapter_id).manifest.alora_invocation_tokens

    def tokenizer(self, adapter_id: str) -> AdapterTokenizer | None:
        """The adapter's own tokenizer and stop ids (``tokenizers.py``), None when it uses the
        base model's.
        Called from request threads, after :meth:`resolve`: a first call loads it (without
        the lock), later ones find it cached."""
        with self._lock:
            entry = self._entry(adapter_id)
            manifest, local = entry.manifest, entry.local_path
        return self._tokenizers.get(manifest, local)

    @property
    def catalogue(self) -> StoreCatalogue | None:
        """The store's catalogue as this worker sees it; None without a store."""
        return self._resolver.catalogue

    # -- references ---------------------------------------------------------------------------
    def acquire(self, adapter_id: str) -> None:
        """Take a reference for a queued request; with overlap, start its store fetch now, not
        at the next step, unless it is ready in a slot (its host copy may have been dropped
        since: nothing needs it again while the slot holds it)."""
        entry, resident = self._acquire(adapter_id)
        if self.overlap and not resident:
            self._ensure(entry)

    def _acquire(self, adapter_id: str) -> tuple[AdapterEntry, bool]:
        """A reference on the adapter, its hit or miss counted; and whether it was ready in a
        slot then."""
        with self._lock:
            entry = self._records.get(adapter_id)
            if entry is None:
                raise AdapterNotFound(
                    f"adapter {adapter_id} was unloaded from this worker as the request "
                    "arrived; retry the request"
                )
            entry.acquire()  # a new request retries a failed load
            m = self.metrics
            resident = self._device_tier.ready(entry)
            if resident:
                m.hits.labels("device").inc()
            else:
                entry.time_load()
                m.misses.labels("device").inc()
                (m.hits if entry.weights is not None else m.misses).labels("host").inc()
            return entry, resident

    def release(self, adapter_id: str) -> None:
        with self._lock:
            self._entry(adapter_id).release()
            self._changed.notify_all()  # its host bytes may be what a waiting load needs

    # -- tiers --------------------------------------------------------------------------------
    def ready(self, adapter_id: str) -> bool:
        """True when the adapter sits in a slot whose copy completed (never blocks)."""
        with self._lock:
            entry = self._records.get(adapter_id)
            return entry is not None and self._device_tier.ready(entry)

    def place(self, adapter_id: str) -> bool:
        """Make progress towards the adapter being in a slot; True once it is ready there.

        Raises the adapter's error when it cannot be loaded: its requests fail with it (rule 5).
        """
        entry = self._entry(adapter_id)
        self._raise_error(entry)
        if self._place(entry):
            if entry.load is not None:
                self._close_timeline(entry)
            return True
        self._raise_error(entry)
        return False

    def place_all(self, adapter_ids: Sequence[str], keep: Set[str] = frozenset()) -> bool:
        """:meth:`place` for every adapter of a request (a mix's components); True once all
        are ready. ``keep``: the adapters of the running requests and of the waiting ones ahead
        of this one.

        A mix claims no slot until every component it misses can have one at once, so two
        mixes never each hold part of their slots while waiting for the other's. Slots held
        by adapters that only requests behind it need (referenced, so never evicted as idle)
        count as free for it: it evicts them, least recently used first, as the queue's order
        gives it the right to (they are placed again for their requests, as after any
        eviction). Example, 2 slots holding ``a`` and ``c``, waiting mixes (a, b) then (b, c):
        the first evicts ``c`` for ``b`` and runs; without it both would wait forever."""
        if len(adapter_ids) == 1:
            return self.place(adapter_ids[0])
        entries = [self._entry(adapter_id) for adapter_id in adapter_ids]
        for entry in entries:
            self._raise_error(entry)
        with self._lock:
            missing = sum(1 for entry in entries if entry.slot is None)
            short = missing - self._device_tier.claimable(self._records.entries())
            if short > 0:
                spare = sorted(
                    (e for e in self._records.entries()
                     if e.slot is not None and e.refs > 0 and not e.pinned
                     and e.adapter_id not in keep and e.adapter_id not in adapter_ids),
                    key=lambda e: e.last_used,
                )
                if short > len(spare):
                    return False
                for victim in spare[:short]:
                    log.debug("evicting %s, needed only behind a mix", victim.name)
                    self.metrics.evictions.labels("device").inc()
                    self._device_tier.evict(victim)
        return all([self.place(adapter_id) for adapter_id in adapter_ids])

    def _close_timeline(self, entry: AdapterEntry) -> None:
        """``entry``'s request is admitted: where its wait went, to the log and the metrics."""
        with self._lock:
            timeline = entry.end_load_timing()
        if timeline is None or not timeline.copied:
            return  # a layered landing, or a copy before this request: nothing to split
        timeline.admitted = time.perf_counter()
        phases = timeline.phases()
        for phase, (wall, cpu) in phases.items():
            self.metrics.cold_load_phase_seconds.labels(phase, "wall").observe(wall)
            if cpu is not None:
                self.metrics.cold_load_phase_seconds.labels(phase, "cpu").observe(cpu)
        log.debug("cold load of %s: %s", entry.name, timeline.describe())

    def _place(self, entry: AdapterEntry) -> bool:
        """Starts the host fetch if needed, then takes a free slot or the least recently used
        idle one and submits the copy on the load stream after the last step that read that
        slot. Without overlap it waits for the fetch and the copy."""
        with self._lock:
            if self._device_tier.ready(entry):
                return True
        self._ensure(entry)
        with self._lock:
            weights = entry.weights
            if (entry.error is None and weights is not None and entry.slot is None
                    and not self._device_tier.claim(self._records.entries(), entry, weights)):
                return False
            event = entry.slot_event
        if event is not None and not self.overlap:
            event.wait()
        if event is not None and event.query() and getattr(event, "error", None) is not None:
            failed = SourceUnavailable(f"copying {entry.name} to the device failed")
            with self._lock:
                self._fail(entry, failed)
                self._device_tier.evict(entry)
        with self._lock:
            return self._device_tier.ready(entry) and entry.error is None

    def prefetch(self, adapter_ids: Iterable[str], limit: int) -> None:
        """Start loads for the first ``limit`` distinct adapters of ``adapter_ids`` (the next
        waiting requests') that are not failed, into free or idle slots."""
        seen: set[str] = set()
        for adapter_id in adapter_ids:
            if len(seen) >= limit:
                break
            with self._lock:
                entry = self._records.get(adapter_id)
                if entry is None or adapter_id in seen or entry.error is not None:
                    continue
                ready = self._device_tier.ready(entry)
            seen.add(adapter_id)
            if not ready:
                self._place(entry)

    def hold_for_loads(self, adapter_ids: Iterable[str]) -> bool:
        """Hold new prefills this step for loads about to land? ``adapter_ids``: the adapters
        of the next waiting requests; ``device_tier.py`` decides."""
        now = time.perf_counter()
        with self._lock:
            entries = [self._records.get(adapter_id) for adapter_id in adapter_ids]
            etas = [
                self._device_tier.eta(e, now) for e in entries
                if e is not None and e.error is None and not self._device_tier.ready(e)
            ]
        if etas and self._cost_model.should_hold(etas):
            return True
        self._cost_model.released()
        return False

    # -- the step -----------------------------------------------------------------------------
    def prepare_step(self, adapter_ids: Sequence[str | None]) -> StepAdapters:
        """The slot of each of a step's sequences (``adapter_ids``, None for the base model) and
        the copies its compute stream must wait on (rule 1). Every adapter must be placed."""
        with self._lock:  # a referenced adapter is never forgotten: a KeyError is a bug
            return self._device_tier.step(
                [None if adapter_id is None else self._entry(adapter_id)
                 for adapter_id in adapter_ids]
            )

    def mark_read(self, step: StepAdapters, event: Event) -> None:
        """Record that the step behind ``event`` read its slots (rule 2)."""
        with self._lock:
            self._device_tier.mark_read(step.read, event)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step of ``tokens`` took ``seconds``: the cost model's step cost."""
        self._cost_model.observe_step(tokens, seconds)

    @property
    def fetching(self) -> bool:
        """Whether a store fetch is in flight (read without the lock: a hint for one gap)."""
        return self._loader.fetching

    @property
    def resolving(self) -> bool:
        """Whether a request waits on the store for the manifest of an adapter this worker does
        not hold (its DescribeAdapter in flight, before the request reaches the scheduler; read
        without the lock: a hint for one gap)."""
        return self._loader.fetcher.describing

    # -- layer-ordered admission (only with ``layered``; the engine's layered_prefill.py) ---
    @property
    def layered(self) -> bool:
        """Whether slots fill layer by layer for requests admitted while their adapter lands."""
        return self._layered is not None

    def place_layered(self, adapter_id: str) -> int:
        """For an adapter :meth:`place` found not ready yet: if it is still landing, a slot
        filled layer by layer (``layered.py``); the leading layers a prefill may run
        now. Raises InvalidAdapter when its manifest does not fit the base model."""
        layered = self._layered
        assert layered is not None, "layer-ordered admission is off"
        with self._lock:
            entry = self._entry(adapter_id)
            if entry.slot is None and entry.fetching and entry.layers_landed:
                try:
                    weights = landing_weights(entry, self.host, self._device, self.config,
                                              self.slots.max_rank, self.slots.vocab_budget)
                except InvalidAdapter as err:  # it does not fit this base model (rule 6)
                    self._fail(entry, err)
                    raise
                if weights is not None:
                    layered.claim(self._records.entries(), entry, weights, entry.layers_landed)
            return layered.layers_ready(entry)

    def layers_ready(self, adapter_id: str) -> int:
        """Leading layers of the adapter in its slot (never blocks); raises its error."""
        layered = self._layered
        assert layered is not None, "layer-ordered admission is off"
        entry = self._entry(adapter_id)
        self._raise_error(entry)
        with self._lock:
            return layered.layers_ready(entry)

    @contextmanager
    def landing_step(self, adapter_id: str) -> Iterator[StepAdapters]:
        """:meth:`prepare_step` for a layer span of a request whose adapter still lands, then
        :meth:`mark_read` with the compute stream's event, however the span ends.

        The adapter's fetch may fail meanwhile and take its slot back (``LayeredSlots.follow``, on
        the thread that reads the fetch's reports); until the span's read is recorded the slot
        is handed to no other adapter, whose copy would otherwise not wait for the span's
        kernels (rule 2; on a CPU the span has run by then, on CUDA it may still be queued)."""
        with self._lock:
            step = self._device_tier.step([self._entry(adapter_id)])
            self._device_tier.hold(step.slots)
        try:
            yield step
        finally:
            event = self._device.record_compute()
            with self._lock:
                self._device_tier.release(step.slots, event)

    # -- the host tier ----------------------------------------------------------------------
    def _ensure(self, entry: AdapterEntry) -> None:
        """Start fetching ``entry`` into host memory unless it is there or on its way: on a
        fetch thread with overlap, else here (call it without the lock)."""
        with self._lock:
            if not self._loader.begin(self._records.entries(), entry):
                return
            storage = self.host.storage(entry)
        if self.overlap:
            self._pool.submit(self._fetch, entry, storage)
        else:
            self._fetch(entry, storage)

    def _fetch(self, entry: AdapterEntry, storage: torch.Tensor | None) -> None:
        """Fetch ``entry`` (begun), record how it ended; with overlap, place it into a slot at
        once if a request waits for it, not at the next step."""
        landed: AdapterWeights | LorastreamError = SourceUnavailable(
            f"fetching adapter {entry.name} was interrupted"
        )
        try:
            landed = self._loader.fetch(entry, storage, partial(self._layers_landed, entry))
        except LorastreamError as err:
            landed = err
        finally:  # however the fetch ended, it ends here (anything else still propagates)
            with self._changed:
                self._loader.end(entry, landed)
                if self._layered is not None:
                    self._layered.follow(entry)
                waited_for = entry.refs > 0 and entry.error is None
                self._changed.notify_all()
        if self.overlap and waited_for:
            self._place(entry)

    def _layers_landed(self, entry: AdapterEntry, count: int) -> None:
        """The fetch's report that ``entry``'s first ``count`` layers landed, verified:
        layer-ordered admission copies them on."""
        with self._changed:
            if entry.land_layers(count):
                if self._layered is not None:
                    self._layered.follow(entry)
                self._changed.notify_all()

    def _fail(self, entry: AdapterEntry, err: LorastreamError) -> None:
        with self._changed:
            self._loader.fail(entry, err)
            self._changed.notify_all()

    # -- operator calls: load --------------------------------------------------------------
    def load(
        self, name: str, local_path: Path | None, pin: bool, timeout_s: float
    ) -> AdapterStatus:
        """Bring ``name`` into host memory and, if a slot is free, onto the device; its status.

        Blocks the calling (operator) thread: it waits for the fetch to end and for the copy's
        event, never polls. When every slot is held by adapters in use, the host tier is enough.
        """
        if local_path is not None:
            entry = self._register_local(name, local_path, pin)
        else:
            entry = self._resolver.resolve(name)
            if pin:
                with self._lock:
                    entry.pin()
        entry, _ = self._acquire(entry.adapter_id)  # keep it from being evicted while we wait
        try:
            deadline = time.monotonic() + timeout_s
            self._wait_on_host(entry, deadline, f"loading {name} took over {timeout_s:.0f}s")
            while not self._place(entry):
                with self._lock:
                    self._raise_error(entry)
                    copy = entry.slot_event if entry.slot is not None else None
                remaining = deadline - time.monotonic()
                if copy is None or remaining <= 0:
                    break  # every slot is held by adapters in use: the host tier is enough
                copy.wait(remaining)
        finally:
            self.release(entry.adapter_id)
        with self._lock:
            entry.end_load_timing()  # an operator's load: no request waited on it
            return adapter_status(name, entry)

    def _register_local(self, name: str, path: Path, pin: bool) -> AdapterEntry:
        """Read, check and keep a local PEFT directory under ``name`` (blocking)."""
        weights, manifest = self._loader.read_local(name, path)
        with self._lock:
            entry = self._records.get(weights.adapter_id) or AdapterEntry(
                weights.adapter_id, name, manifest, local_path=path
            )
            self._loader.keep_local(self._records.entries(), entry, weights)
            self._records.keep(name, entry)
            entry.register_local(path, pin)
            return entry

    def _wait_on_host(self, entry: AdapterEntry, deadline: float, timeout_message: str) -> None:
        """Block until ``entry`` is in host memory: start its fetch, and again whenever a fetch
        ended or a reference dropped (the budget may have room now). Raises the adapter's
        error, or :class:`SourceUnavailable` at ``deadline`` (``time.monotonic``)."""
        while True:
            self._ensure(entry)  # without overlap the fetch runs here
            with self._changed:
                if entry.weights is not None:
                    return
                if entry.error is not None:
                    raise entry.error
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SourceUnavailable(timeout_message)
                self._changed.wait(remaining)

    # -- unload and reads ---------------------------------------------------------------------
    def unload(self, name: str) -> None:
        with self._lock:
            entry = self._records.named(name)
            if entry is None:
                raise AdapterNotFound(f"adapter {name!r} is not loaded on this worker")
            if entry.refs:
                raise InvalidArgument(
                    f"adapter {name} is used by {entry.refs} queued or running requests; retry "
                    "once they finish"
                )
            if entry.copying or entry.fetching:
                raise InvalidArgument(
                    f"adapter {name} is being loaded on this worker; retry once it is resident"
                )
            self._device_tier.evict(entry)
            self.host.drop(entry)
            entry.unpin()
            self._records.unname(name)
            self._changed.notify_all()

    def status(self, name: str) -> AdapterStatus:
        return self._records.status(name)

    def statuses(self) -> list[AdapterStatus]:
        """One status per name (an adapter known under two names is listed twice)."""
        return self._records.statuses()

    def usage(self) -> TierUsage:
        return self._records.usage(self.host_budget)

    def inspect(self, name: str) -> AdapterSnapshot | None:
        """The internal state of the adapter ``name`` stands for, as plain values (tests)."""
        return self._records.inspect(name)

    # -- helpers ------------------------------------------------------------------------------
    def _entry(self, adapter_id: str) -> AdapterEntry:
        entry = self._records.get(adapter_id)
        if entry is None:  # referenced adapters are never forgotten: this is a bug
            raise KeyError(adapter_id)
        return entry

    def _raise_error(self, entry: AdapterEntry) -> None:
        if (error := entry.error) is not None:
            raise error
