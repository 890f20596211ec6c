"""The worker's operator calls in plain Python: load, unload, list adapters, stats."""

from __future__ import annotations

from pathlib import Path

from lorastream.core.adapter_fit import BaseShape
from lorastream.core.generation import AdapterStatus, WorkerStats
from lorastream.worker.engine.engine import Engine
from lorastream.worker.model.kv_cache import BLOCK_SIZE

LOAD_TIMEOUT_S = 600.0


class WorkerOperations:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.adapters = engine.adapters

    def load_adapter(self, name: str, local_path: str = "", pin: bool = False) -> AdapterStatus:
        """Bring ``name`` into host memory and, if a slot is free, onto the device (blocking)."""
        path = Path(local_path) if local_path else None
        return self.adapters.load(name, path, pin, LOAD_TIMEOUT_S)

    def unload_adapter(self, name: str) -> None:
        self.adapters.unload(name)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (requests sent afterwards reuse none of them)."""
        self.engine.reset_prefix_cache()

    def list_adapters(self) -> list[AdapterStatus]:
        return self.adapters.statuses()

    def base_shape(self) -> BaseShape:
        """What an adapter must match to fit this worker's base model (the gateway's list)."""
        config = self.engine.model.config
        return BaseShape(config.num_layers, {**config.module_shapes(), **config.vocab_shapes()})

    def stats(self) -> WorkerStats:
        engine = self.engine
        allocator = engine.kv.allocator
        usage = self.adapters.usage()
        return WorkerStats(
            base_model=engine.base_model_name,
            waiting_requests=engine.waiting,
            running_requests=engine.running,
            loading_adapters=usage.loading,
            device_slots_total=engine.slots.num_slots,
            device_slots_used=usage.slots_used,
            host_bytes_used=usage.host_bytes_used,
            host_bytes_budget=usage.host_bytes_budget,
            kv_tokens_used=allocator.used_blocks * BLOCK_SIZE,
            kv_tokens_total=engine.kv.capacity_tokens,
            generated_tokens_total=engine.stats.generated_tokens,
            requests_finished_total=engine.stats.finished_requests,
        )
