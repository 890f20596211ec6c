"""The gateway's Prometheus metrics, in a registry of their own (one per app).

Counters and histograms, labels in brackets:

- ``lorastream_gateway_requests_total`` [endpoint, status]: HTTP responses of /v1/*
- ``lorastream_gateway_ttft_seconds`` [model]: request arrival to the first token
- ``lorastream_gateway_itl_seconds`` [model]: time between streamed tokens
- ``lorastream_gateway_e2e_latency_seconds`` [model]: request arrival to the last token
- ``lorastream_gateway_generated_tokens_total`` [model]: completion tokens
- ``lorastream_gateway_routing_decisions_total`` [reason]: device, host, hash, least-loaded
- ``lorastream_gateway_worker_healthy`` [worker]: gauge, 1 healthy, 0 not
- ``lorastream_gateway_worker_queue_depth`` [worker]: gauge, waiting + running (routing's view)
- ``lorastream_gateway_worker_retries_total`` [worker]: requests moved off it when found dead
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
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

    def observe_tokens(self, model: str, gap_s: float, tokens: int) -> None:
        """``tokens`` arrived ``gap_s`` after the previous ones: each counts gap / tokens."""
        if tokens <= 0:
            return
        per_token = gap_s / tokens
        child = self.itl.labels(model)
        for _ in range(tokens):
            child.observe(per_token)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
