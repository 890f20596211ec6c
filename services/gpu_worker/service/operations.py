"""The worker's operator calls in plain Python: load, unload, list adapters, stats."""

from __future__ import annotations

import time
from pathlib import Path

from lorastream.core.errors import SourceUnavailable
from lorastream.core.generation import AdapterStatus, WorkerStats
from lorastream.worker.engine.engine import Engine
from lorastream.worker.loading.entry import AdapterEntry
from lorastream.worker.model.kv_cache import BLOCK_SIZE

LOAD_TIMEOUT_S = 600.0


class WorkerOperations:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.adapters = engine.adapters

    def load_adapter(self, name: str, local_path: str = "", pin: bool = False) -> AdapterStatus:
        """Bring ``name`` into host memory and, if a slot is free, onto the device (blocking)."""
        manager = self.adapters
        if local_path:
            entry = manager.register_local(name, Path(local_path), pin)
        else:
            entry = manager.resolve(name)
            if pin:
                entry.pinned = True
        manager.acquire(entry)  # keep it from being evicted while we wait
        try:
            deadline = time.monotonic() + LOAD_TIMEOUT_S
            manager.ensure_host(entry)
            while entry.weights is None:
                if entry.error is not None:
                    raise entry.error
                if time.monotonic() > deadline:
                    raise SourceUnavailable(f"loading {name} took over {LOAD_TIMEOUT_S:.0f}s")
                time.sleep(0.005)
            while not manager.place(entry):  # a slot held by busy adapters: host tier is enough
                if entry.error is not None:
                    raise entry.error
                if entry.slot is None or time.monotonic() > deadline:
                    break
                time.sleep(0.002)
        finally:
            manager.release(entry)
        return self._status(name, entry)

    def unload_adapter(self, name: str) -> None:
        self.adapters.unload(name)

    def list_adapters(self) -> list[AdapterStatus]:
        statuses = []
        for entry in self.adapters.entries():
            for name in self.adapters.names_of(entry) or [entry.name]:
                statuses.append(self._status(name, entry))
        return statuses

    def stats(self) -> WorkerStats:
        engine = self.engine
        allocator = engine.kv.allocator
        return WorkerStats(
            base_model=engine.base_model_name,
            waiting_requests=engine.waiting,
            running_requests=engine.running,
            loading_adapters=self.adapters.loading,
            device_slots_total=engine.slots.num_slots,
            device_slots_used=self.adapters.slots_used,
            host_bytes_used=self.adapters.host_bytes_used,
            host_bytes_budget=self.adapters.host_budget,
            kv_tokens_used=allocator.used_blocks * BLOCK_SIZE,
            kv_tokens_total=engine.kv.capacity_tokens,
            generated_tokens_total=engine.stats.generated_tokens,
            requests_finished_total=engine.stats.finished_requests,
        )

    @staticmethod
    def _status(name: str, entry: AdapterEntry) -> AdapterStatus:
        return AdapterStatus(
            name=name,
            adapter_id=entry.adapter_id,
            residency=entry.residency.value,
            rank=entry.manifest.rank,
            nbytes=entry.manifest.total_bytes,
            pinned=entry.pinned,
            references=entry.refs,
            slot=-1 if entry.slot is None else entry.slot,
        )
