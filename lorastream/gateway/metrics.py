"""The gateway's Prometheus metrics, in a registry of their own (one per app).

Counters and histograms, labels in brackets:

- ``lorastream_gateway_requests_total`` [endpoint, status]: HTTP responses of /v1/*
- ``lorastream_gateway_ttft_seconds`` [model]: request arrival to the first token
- ``lorastream_gateway_itl_seconds`` [model]: time between streamed tokens
- ``lorastream_gateway_e2e_latency_seconds`` [model]: request arrival to the last token
- ``lorastream_gateway_generated_tokens_total`` [model]: completion tokens
- ``lorastream_gateway_model_requests_total`` [model]: generations routed
- ``lorastream_gateway_routing_decisions_total`` [reason]: device, host, hash, least-loaded,
  prefix
- ``lorastream_gateway_adapter_tier_requests_total`` [tier]: requests for an adapter by where
  the worker they were routed to held it: ``device`` (a hit), ``host`` (in host memory or
  loading), ``absent``; the hit rate is device / all
- ``lorastream_gateway_worker_adapters`` [worker, tier]: gauge, adapters each worker holds on
  ``device`` and in ``host`` memory (loading included), as routing sees them at scrape time
- ``lorastream_gateway_worker_healthy`` [worker]: gauge, 1 healthy, 0 not
- ``lorastream_gateway_worker_queue_depth`` [worker]: gauge, waiting + running (routing's view)
- ``lorastream_gateway_worker_retries_total`` [worker]: requests moved off it when found dead

``model`` is bounded (``--metrics-adapter-labels N``): the N busiest models by name, every other
one as ``other`` (:mod:`lorastream.gateway.adapter_labels`); a model that loses its label loses
its series.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from lorastream.gateway.adapter_labels import AdapterLabels
from lorastream.gateway.config import GatewaySettings
from lorastream.gateway.routing import RouteDecision, Tier, WorkerView

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST
DEFAULT_ADAPTER_LABELS: int = GatewaySettings.model_fields["metrics_adapter_labels"].default
TIER_LABELS = {Tier.DEVICE: "device", Tier.HOST: "host", Tier.ABSENT: "absent"}


class _ResidencyCollector(Collector):
    """Adapters per worker and tier, from the router's views at scrape time."""

    def __init__(self) -> None:
        self.read: Callable[[], Sequence[WorkerView]] = list

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "lorastream_gateway_worker_adapters",
            "Adapters a worker holds per tier (host includes loading), as routing sees them.",
            labels=["worker", "tier"],
        )
        for view in self.read():
            tiers = list(view.residency.values())
            for tier in (Tier.DEVICE, Tier.HOST):
                family.add_metric([view.target, TIER_LABELS[tier]], tiers.count(tier))
        yield family


class GatewayMetrics:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        adapter_labels: int = DEFAULT_ADAPTER_LABELS,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "lorastream_gateway_requests", "HTTP requests by endpoint and status code.",
            ["endpoint", "status"], registry=r,
        )
        self.ttft = Histogram(
            "lorastream_gateway_ttft_seconds", "Time to first token, from request arrival.",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "lorastream_gateway_itl_seconds", "Inter-token latency of streamed tokens.",
            ["model"], buckets=_ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "lorastream_gateway_e2e_latency_seconds", "Request arrival to the last token.",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.tokens = Counter(
            "lorastream_gateway_generated_tokens", "Completion tokens generated.",
            ["model"], registry=r,
        )
        self.routing = Counter(
            "lorastream_gateway_routing_decisions", "Routing decisions by reason.",
            ["reason"], registry=r,
        )
        self.worker_healthy = Gauge(
            "lorastream_gateway_worker_healthy", "1 when the worker passes its health check.",
            ["worker"], registry=r,
        )
        self.worker_queue = Gauge(
            "lorastream_gateway_worker_queue_depth",
            "Waiting + running requests on the worker, as the router sees them.",
            ["worker"], registry=r,
        )
        self.retries = Counter(
            "lorastream_gateway_worker_retries",
            "Requests moved to another worker because this one was unreachable.",
            ["worker"], registry=r,
        )
        self.model_requests = Counter(
            "lorastream_gateway_model_requests",
            "Generations routed, by model (the busiest by name, the rest as 'other').",
            ["model"], registry=r,
        )
        self.adapter_tier = Counter(
            "lorastream_gateway_adapter_tier_requests",
            "Requests for an adapter by where the worker they were routed to held it.",
            ["tier"], registry=r,
        )
        for label in TIER_LABELS.values():  # export zeros from the start
            self.adapter_tier.labels(label)
        self._residency = _ResidencyCollector()
        r.register(self._residency)
        self.adapter_labels = AdapterLabels(adapter_labels, on_drop=self._drop_model)

    # -- per-model series, bounded --------------------------------------------------------
    def model_label(self, model: str) -> str:
        """The ``model`` label of ``model``'s series: its name, or ``other``."""
        return self.adapter_labels.label(model)

    def _drop_model(self, model: str) -> None:
        """``model`` lost its label: remove its series (from now on it counts as ``other``)."""
        for metric in (self.ttft, self.itl, self.e2e, self.tokens, self.model_requests):
            with contextlib.suppress(KeyError):
                metric.remove(model)

    # -- routing ----------------------------------------------------------------------------
    def routed(
        self, model: str, decision: RouteDecision, views: Sequence[WorkerView], *,
        base_model: bool,
    ) -> None:
        """A generation for ``model`` was routed by ``decision`` over ``views``: count its reason,
        its model and (an adapter's) the tier the chosen worker held the adapter at."""
        self.routing.labels(decision.reason.value).inc()
        self.model_requests.labels(self.adapter_labels.observe(model)).inc()
        if not base_model:
            tier = next(v.tier(model) for v in views if v.target == decision.target)
            self.adapter_tier.labels(TIER_LABELS[tier]).inc()

    def watch_residency(self, read: Callable[[], Sequence[WorkerView]]) -> None:
        """Report the adapters ``read()``'s workers hold per tier at every scrape."""
        self._residency.read = read

    # -- latency ----------------------------------------------------------------------------
    def first_token(self, model: str, seconds: float) -> None:
        self.ttft.labels(self.model_label(model)).observe(seconds)

    def finished(self, model: str, seconds: float, completion_tokens: int) -> None:
        label = self.model_label(model)
        self.e2e.labels(label).observe(seconds)
        self.tokens.labels(label).inc(completion_tokens)

    def observe_tokens(self, model: str, gap_s: float, tokens: int) -> None:
        """``tokens`` arrived ``gap_s`` after the previous ones: each counts gap / tokens."""
        if tokens <= 0:
            return
        per_token = gap_s / tokens
        child = self.itl.labels(self.model_label(model))
        for _ in range(tokens):
            child.observe(per_token)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
