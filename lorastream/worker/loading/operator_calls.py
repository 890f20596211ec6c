"""The adapter manager's operator calls: load, unload, and the status reads.

An operator thread (a ``LoadAdapter`` RPC, ``lorastream up``'s registrations, a test) asks for an
adapter by name and blocks until it is in host memory and, when a slot is free, on the device:
it waits on the fetch's end and on the copy's event, never polls. The other calls read the
records. These are the :class:`~lorastream.worker.loading.manager.AdapterManager`'s methods,
kept apart from its load path (``manager.py``: place -> ensure -> fetch -> claim), which
:meth:`OperatorCalls.load` drives: the same object, the same lock, the same owners.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from lorastream.core.errors import AdapterNotFound, InvalidArgument, SourceUnavailable
from lorastream.core.generation import AdapterStatus
from lorastream.worker.loading.device_tier import DeviceTier
from lorastream.worker.loading.entry import AdapterEntry
from lorastream.worker.loading.host_loader import HostLoader
from lorastream.worker.loading.host_tier import HostTier
from lorastream.worker.loading.names import NameResolver
from lorastream.worker.loading.records import AdapterRecords
from lorastream.worker.loading.status import AdapterSnapshot, TierUsage, adapter_status


class OperatorCalls:
    """Mixed into ``AdapterManager``, which sets these attributes and defines the load path."""

    host: HostTier
    host_budget: int
    _lock: threading.RLock
    _changed: threading.Condition  # on ``_lock``: a fetch ended, a reference dropped
    _records: AdapterRecords
    _resolver: NameResolver
    _loader: HostLoader
    _device_tier: DeviceTier

    # the load path, in manager.py
    def _acquire(self, adapter_id: str) -> AdapterEntry:
        raise NotImplementedError

    def release(self, adapter_id: str) -> None:
        raise NotImplementedError

    def _place(self, entry: AdapterEntry) -> bool:
        raise NotImplementedError

    def _ensure(self, entry: AdapterEntry) -> None:
        raise NotImplementedError

    def _raise_error(self, entry: AdapterEntry) -> None:
        raise NotImplementedError

    # -- load ---------------------------------------------------------------------------------
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
        entry = self._acquire(entry.adapter_id)  # keep it from being evicted while we wait
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
