"""llm-d-router's endpoint picker, as much of it as routes by LoRA: its metrics extractor (the
vLLM names) and its lora-affinity, queue and kv-cache scorers, re-implemented in Python to check
lorastream's ``/metrics`` against it and to route a trace the way it would.

Ported from ``llm-d/llm-d-router`` at ``v0.10.0-rc.1-62-gebab68792`` (commit
``ebab687927f5331c1b39defcb579a07951bce56c``):

- ``pkg/epp/framework/plugins/datalayer/extractor/metrics/mapping_registry.go``: the ``vllm``
  engine's names (``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
  ``vllm:kv_cache_usage_perc``, ``vllm:lora_requests_info``, ``vllm:cache_config_info``).
- ``.../extractor/metrics/spec.go`` ``Spec.getLatestMetric``: of a family's series, the one with
  the largest timestamp (an absent timestamp is 0; the first wins a tie); ``extractValue``: a
  gauge's or counter's value; the queue and running counts are ``int()`` of it.
- ``.../extractor/metrics/loraspec.go`` ``LoRASpec.getLatestMetric``: of
  ``vllm:lora_requests_info``'s series, the one with the largest *value* (first wins a tie); a
  missing family leaves the LoRA view as it was.
- ``.../extractor/metrics/extractor.go`` ``populateLoRAMetrics``, ``addAdapters``: labels
  ``running_lora_adapters`` and ``waiting_lora_adapters`` split on ``,``, each name trimmed,
  empty names dropped; ``max_lora`` an integer; ``populateCacheInfoMetrics``: ``block_size``,
  ``num_gpu_blocks``.
- ``pkg/epp/framework/plugins/scheduling/scorer/loraaffinity/lora_affinity.go``: 1.0 where the
  adapter is running, else 0.8 where running + waiting < max_lora, else 0.6 where it is waiting,
  else 0; ``.../queuedepth/queue.go``: (max - queue) / (max - min) over the candidates, 1.0 when
  all are equal; ``.../kvcacheutilization/kvcache_utilization.go``: 1 - usage.
- The picker sums weight x score and takes the best (``max-score-picker``; ties broken at random).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

QUEUED = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
LORA_INFO = "vllm:lora_requests_info"
CACHE_INFO = "vllm:cache_config_info"


@dataclass(frozen=True)
class EndpointView:
    """What the picker knows of one endpoint after a scrape (its ``fwkdl.Metrics``)."""

    waiting_queue_size: int = 0
    running_requests_size: int = 0
    kv_cache_usage: float = 0.0
    active_models: frozenset[str] = field(default_factory=frozenset)
    waiting_models: frozenset[str] = field(default_factory=frozenset)
    max_active_models: int = 0
    block_size: int = 0
    num_gpu_blocks: int = 0


def _families(text: str) -> dict[str, list[Sample]]:
    """Samples by metric family name (the extractor's ``PrometheusMetricMap``)."""
    return {f.name: list(f.samples) for f in text_string_to_metric_families(text)}


def _latest_by_timestamp(samples: list[Sample]) -> Sample | None:
    latest, recent = None, -1.0
    for sample in samples:
        ts = float(sample.timestamp or 0) * 1000
        if ts > recent:
            latest, recent = sample, ts
    return latest


def _latest_by_value(samples: list[Sample]) -> Sample | None:
    latest, recent = None, -1.0
    for sample in samples:
        if sample.value > recent:
            latest, recent = sample, sample.value
    return latest


def _adapters(csv: str) -> frozenset[str]:
    return frozenset(name.strip() for name in csv.split(",") if name.strip())


def extract(text: str, previous: EndpointView | None = None) -> EndpointView:
    """The endpoint's view after a scrape returning ``text``, as the core metrics extractor
    updates ``previous`` (what a missing family leaves unchanged)."""
    view = previous or EndpointView()
    families = _families(text)
    values: dict[str, object] = {}
    for name, key, cast in ((QUEUED, "waiting_queue_size", int),
                            (RUNNING, "running_requests_size", int),
                            (KV_USAGE, "kv_cache_usage", float)):
        sample = _latest_by_timestamp(families.get(name, []))
        if sample is not None:
            values[key] = cast(sample.value)
    lora = _latest_by_value(families.get(LORA_INFO, []))
    if lora is not None:
        max_lora = lora.labels.get("max_lora", "")
        values.update(
            active_models=_adapters(lora.labels.get("running_lora_adapters", "")),
            waiting_models=_adapters(lora.labels.get("waiting_lora_adapters", "")),
            max_active_models=int(max_lora) if max_lora else view.max_active_models,
        )
    cache = _latest_by_timestamp(families.get(CACHE_INFO, []))
    if cache is not None:
        values["block_size"] = int(cache.labels.get("block_size") or 0)
        if cache.labels.get("num_gpu_blocks"):
            values["num_gpu_blocks"] = int(cache.labels["num_gpu_blocks"])
    return replace(view, **values)  # type: ignore[arg-type]  # values: fields by name, typed as them


def lora_affinity(view: EndpointView, model: str) -> float:
    if model in view.active_models:
        return 1.0
    if len(view.active_models) + len(view.waiting_models) < view.max_active_models:
        return 0.8
    if model in view.waiting_models:
        return 0.6
    return 0.0


def queue_scores(views: Sequence[EndpointView]) -> list[float]:
    sizes = [v.waiting_queue_size for v in views]
    low, high = min(sizes), max(sizes)
    return [1.0 if high == low else (high - s) / (high - low) for s in sizes]


def kv_cache_scores(views: Sequence[EndpointView]) -> list[float]:
    return [1 - v.kv_cache_usage for v in views]


@dataclass(frozen=True)
class PickerWeights:
    """The scheduling profile's weights (deploy/k8s/inference-pool/epp-config.yaml)."""

    lora_affinity: float = 2.0
    queue: float = 1.0
    kv_cache: float = 1.0


def pick(views: Sequence[EndpointView], model: str, rng: random.Random,
         weights: PickerWeights = PickerWeights()) -> int:
    """The index of the endpoint the picker sends a request for ``model`` to."""
    queue, kv = queue_scores(views), kv_cache_scores(views)
    totals = [
        weights.lora_affinity * lora_affinity(v, model) + weights.queue * q + weights.kv_cache * k
        for v, q, k in zip(views, queue, kv, strict=True)
    ]
    best = max(totals)
    return rng.choice([i for i, t in enumerate(totals) if t == best])
