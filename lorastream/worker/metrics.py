"""The worker's Prometheus metrics (its own registry, served on ``--metrics-port``).

Per tier (``host``, ``device``): resident adapters and bytes (read from the adapter manager at
scrape time), hits, misses and evictions; the device bytes the slots reserve, by part
(``projections``, and a MoE base's ``experts``). Histograms: fetch (store -> host buffer, the whole
stream), host landing (time spent writing chunks into host buffers), device copy (a load-stream
job). Requests waiting on a load, and queue gauges, also at scrape time.

A *hit* at a tier means a request found its adapter already there when it arrived: ``device``
hit, else ``host`` hit (a device miss), else a miss at both tiers (a fetch from the store).

Beside its own ``lorastream_worker_*`` names, the worker exports the vLLM-named gauges that
Kubernetes' endpoint picker (llm-d-router, ``docs/plugin-metric-protocol.md``) reads, from the
same state at the same scrape: ``vllm:lora_requests_info`` (one series; labels
``running_lora_adapters`` = adapters in device slots, ready, whether or not a request uses them
now; ``waiting_lora_adapters`` = adapters that queued requests (or an operator's load) need and
that are not ready in a slot; ``max_lora`` = slots; value = the scrape's unix time),
``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` (a
fraction, as vLLM's) and ``vllm:cache_config_info{block_size,num_gpu_blocks}``. docs/metrics.md
says why "running" means resident here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from lorastream.core.metrics_http import serve_registry

TIERS = ("host", "device")
# A cold load's phases, in order (loading/load_timeline.py records them), and their total.
COLD_LOAD_PHASES = ("resolve", "queue", "stream", "checksum", "landing", "handoff", "slot_copy",
                    "admission")
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class TierState:
    """What the manager reports at scrape time."""

    resident: dict[str, int]  # tier -> adapters
    resident_bytes: dict[str, int]  # tier -> bytes
    waiting_on_load: int
    waiting: int
    running: int
    kv_tokens_used: int
    prefix_cached_blocks: int = 0  # KV blocks holding a cached prefix (held or idle)
    prefix_hit_rate: float = 0.0  # prompt tokens taken from the prefix cache / looked up
    # The endpoint picker's view (the vllm:* gauges): adapter names, sorted.
    ready_adapters: tuple[str, ...] = ()  # in a device slot, copy complete
    held_adapters: tuple[str, ...] = ()  # in a device slot or in host memory (no store fetch)
    wanted_adapters: tuple[str, ...] = ()  # needed by queued requests, not ready in a slot
    adapter_slots: int = 0
    # device bytes every slot reserves, by part: "projections" (LoRA A/B and DoRA factors of
    # the linear layers), "experts" (a MoE base's routed experts, sparse layers only)
    slot_bytes: dict[str, int] = field(default_factory=dict)
    kv_blocks: int = 0  # KV cache blocks in all
    kv_blocks_used: int = 0  # held by some sequence
    kv_block_size: int = 0  # tokens per block


PICKER_RUNNING = ("held", "device")  # what running_lora_adapters lists (docs/metrics.md)


def vllm_families(state: TierState, now: float, running: str = "held"
                  ) -> Iterator[GaugeMetricFamily]:
    """The vLLM-named gauges the endpoint picker reads, for ``state`` read at unix time ``now``;
    ``running``: ``held`` lists the adapters in a slot or in host memory as running (a request
    for one needs no store fetch), ``device`` those ready in a slot only."""
    lora = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Adapters held (running: in a device slot, or in host memory with --picker-running "
        "held), needed by queued requests and not ready (waiting), slots (max_lora); value: "
        "when this was read (unix seconds).",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    listed = state.held_adapters if running == "held" else state.ready_adapters
    lora.add_metric(
        [",".join(listed), ",".join(state.wanted_adapters), str(state.adapter_slots)],
        now,
    )
    yield lora
    yield GaugeMetricFamily(
        "vllm:num_requests_waiting", "Requests in the waiting queue.", value=state.waiting
    )
    yield GaugeMetricFamily(
        "vllm:num_requests_running", "Requests in the running batch.", value=state.running
    )
    yield GaugeMetricFamily(
        "vllm:kv_cache_usage_perc", "Share of KV cache blocks held by sequences (0 to 1).",
        value=state.kv_blocks_used / state.kv_blocks if state.kv_blocks else 0.0,
    )
    config = GaugeMetricFamily(
        "vllm:cache_config_info", "KV cache configuration (value 1).",
        labels=["block_size", "num_gpu_blocks"],
    )
    config.add_metric([str(state.kv_block_size), str(state.kv_blocks)], 1)
    yield config


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], TierState], picker_running: str) -> None:
        self._read = read
        self._picker_running = picker_running

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self._read()
        yield from vllm_families(state, time.time(), self._picker_running)
        resident = GaugeMetricFamily(
            "lorastream_worker_adapters_resident", "Adapters resident per tier.", labels=["tier"]
        )
        nbytes = GaugeMetricFamily(
            "lorastream_worker_adapter_bytes_resident", "Adapter bytes per tier.", labels=["tier"]
        )
        for tier in TIERS:
            resident.add_metric([tier], state.resident.get(tier, 0))
            nbytes.add_metric([tier], state.resident_bytes.get(tier, 0))
        yield resident
        yield nbytes
        slot_bytes = GaugeMetricFamily(
            "lorastream_worker_slot_bytes",
            "Device bytes the adapter slots reserve (all slots, loaded or not), by part.",
            labels=["part"],
        )
        for part, value in sorted(state.slot_bytes.items()):
            slot_bytes.add_metric([part], value)
        yield slot_bytes
        yield GaugeMetricFamily(
            "lorastream_worker_requests_waiting_on_load",
            "Queued requests whose adapter is still loading.",
            value=state.waiting_on_load,
        )
        yield GaugeMetricFamily(
            "lorastream_worker_requests_waiting", "Requests in the waiting queue.",
            value=state.waiting,
        )
        yield GaugeMetricFamily(
            "lorastream_worker_requests_running", "Requests in the running batch.",
            value=state.running,
        )
        yield GaugeMetricFamily(
            "lorastream_worker_kv_tokens_used", "KV cache tokens reserved.",
            value=state.kv_tokens_used,
        )
        yield GaugeMetricFamily(
            "lorastream_worker_prefix_cache_blocks",
            "KV cache blocks holding a cached prompt prefix (in use or idle).",
            value=state.prefix_cached_blocks,
        )
        yield GaugeMetricFamily(
            "lorastream_worker_prefix_cache_hit_rate",
            "Share of admitted prompt tokens whose KV came from the prefix cache, since start.",
            value=state.prefix_hit_rate,
        )


class WorkerMetrics:
    def __init__(self, picker_running: str = "held") -> None:
        """``picker_running``: what ``vllm:lora_requests_info`` lists as running
        (:func:`vllm_families`)."""
        self.picker_running = picker_running
        self.registry = CollectorRegistry()
        r = self.registry
        self.hits = Counter(
            "lorastream_worker_adapter_hits", "Requests whose adapter was at this tier.",
            ["tier"], registry=r,
        )
        self.misses = Counter(
            "lorastream_worker_adapter_misses", "Requests whose adapter was not at this tier.",
            ["tier"], registry=r,
        )
        self.evictions = Counter(
            "lorastream_worker_adapter_evictions", "Adapters evicted from this tier.",
            ["tier"], registry=r,
        )
        self.fetch_seconds = Histogram(
            "lorastream_worker_adapter_fetch_seconds", "Store -> host buffer, whole stream.",
            buckets=_SECONDS, registry=r,
        )
        self.host_landing_seconds = Histogram(
            "lorastream_worker_adapter_host_landing_seconds",
            "Time spent writing one adapter's chunks into its host buffer.",
            buckets=_SECONDS, registry=r,
        )
        self.device_copy_seconds = Histogram(
            "lorastream_worker_adapter_device_copy_seconds",
            "One adapter's host -> slot copy job on the load stream.",
            buckets=_SECONDS, registry=r,
        )
        self.cold_load_phase_seconds = Histogram(
            "lorastream_worker_cold_load_phase_seconds",
            "Where a cold request's wait went, per load: phase (queue, stream, checksum, "
            "landing, handoff, slot_copy, admission, total) and clock (wall, cpu).",
            ["phase", "clock"], buckets=_SECONDS, registry=r,
        )
        self.load_failures = Counter(
            "lorastream_worker_adapter_load_failures", "Adapters that could not be loaded.",
            registry=r,
        )
        for phase in (*COLD_LOAD_PHASES, "total"):  # export every series from the start
            for clock in ("wall", "cpu"):
                self.cold_load_phase_seconds.labels(phase, clock)
        for tier in TIERS:  # export zeros from the start
            self.hits.labels(tier)
            self.misses.labels(tier)
            self.evictions.labels(tier)

    def watch(self, read: Callable[[], TierState]) -> None:
        """Report ``read()`` at every scrape."""
        self.registry.register(_StateCollector(read, self.picker_running))

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics over HTTP; returns the bound port (``port`` 0 picks one)."""
        return serve_registry(self.registry, port, host)
