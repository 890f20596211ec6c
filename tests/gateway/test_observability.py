"""/metrics and /health: latency histograms per adapter, routing reasons, statuses, health."""

from __future__ import annotations

import re

import pytest

from tests.gateway.conftest import BASE, Cluster


def _value(metrics: str, name: str, **labels: str) -> float:
    """The sample ``name{labels}`` (label order as exposed: sorted here for matching)."""
    for line in metrics.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return 0.0


def _metrics(cluster: Cluster) -> str:
    with cluster.gateway.http() as http:
        response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


@pytest.mark.parametrize("model", ["mlp-r8", BASE])
def test_latency_histograms_and_token_counts_are_recorded_per_model(
    cluster: Cluster, model: str
) -> None:
    before = _metrics(cluster)
    client = cluster.gateway.openai()
    client.completions.create(model=model, prompt="Hi", max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True})
    list(client.completions.create(model=model, prompt="Hi", max_tokens=6, temperature=0,
                                   stream=True, extra_body={"ignore_eos": True}))
    after = _metrics(cluster)

    def grew(name: str) -> float:
        return _value(after, name, model=model) - _value(before, name, model=model)

    assert grew("lorastream_gateway_ttft_seconds_count") == 2
    assert grew("lorastream_gateway_e2e_latency_seconds_count") == 2
    assert grew("lorastream_gateway_itl_seconds_count") == 2 * 5  # tokens after the first
    assert grew("lorastream_gateway_generated_tokens_total") == 12
    assert _value(after, "lorastream_gateway_ttft_seconds_sum", model=model) > 0


def test_routing_decisions_and_statuses_are_counted(cluster: Cluster) -> None:
    with cluster.gateway.http() as http:
        for _ in range(3):
            http.post("/v1/completions", json={"model": "attn-r4", "prompt": "x", "max_tokens": 1})
        http.post("/v1/completions", json={"model": "ghost", "prompt": "x"})
    metrics = _metrics(cluster)
    reasons = {r: _value(metrics, "lorastream_gateway_routing_decisions_total", reason=r)
               for r in ("device", "host", "hash", "least-loaded")}
    assert reasons["hash"] >= 1 and reasons["device"] + reasons["host"] >= 1, reasons
    assert _value(metrics, "lorastream_gateway_requests_total",
                  endpoint="/v1/completions", status="404") >= 1
    assert _value(metrics, "lorastream_gateway_requests_total",
                  endpoint="/v1/completions", status="200") >= 3
    for worker in cluster.workers:
        assert _value(metrics, "lorastream_gateway_worker_healthy", worker=worker.target) == 1


def test_health_lists_every_worker_with_its_queue_and_base_model(cluster: Cluster) -> None:
    with cluster.gateway.http() as http:
        response = http.get("/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert set(body["workers"]) == {w.target for w in cluster.workers}
    assert all(w["healthy"] and w["base_model"] == BASE for w in body["workers"].values())
