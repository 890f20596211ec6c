"""/metrics and /health: latency histograms per adapter, routing reasons, statuses, health."""

from __future__ import annotations

import re

import pytest

from lorastream.core.worker_client import WorkerClient
from lorastream.gateway.routing import Tier
from tests.gateway.conftest import BASE, Cluster, ClusterFactory, wait_until


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


def _tiers(metrics: str) -> dict[str, float]:
    return {tier: _value(metrics, "lorastream_gateway_adapter_tier_requests_total", tier=tier)
            for tier in ("device", "host", "absent")}


def test_each_adapter_request_counts_the_tier_its_worker_held_the_adapter_at(
    cluster: Cluster,
) -> None:
    """The second request for an adapter, once a poll shows it on a device, is a device hit;
    the base model counts in no tier."""
    client = cluster.gateway.openai()
    before = _tiers(_metrics(cluster))
    client.completions.create(model="all-r16-rslora", prompt="Hi", max_tokens=1)
    pool = cluster.gateway.state.pool
    assert wait_until(lambda: any(
        v.tier("all-r16-rslora") == Tier.DEVICE for v in pool.views()))
    client.completions.create(model="all-r16-rslora", prompt="Hi", max_tokens=1)
    client.completions.create(model=BASE, prompt="Hi", max_tokens=1)
    after = _tiers(_metrics(cluster))
    grew = {tier: after[tier] - before[tier] for tier in after}
    assert sum(grew.values()) == 2, grew
    assert grew["device"] >= 1, grew


def test_the_residency_gauge_counts_each_workers_adapters_per_tier(cluster: Cluster) -> None:
    cluster.gateway.openai().completions.create(model="mlp-r8", prompt="Hi", max_tokens=1)

    def truth() -> dict[tuple[str, str], int]:
        """Adapters per (worker, tier), as each worker itself lists them."""
        counts = {(w.target, tier): 0 for w in cluster.workers for tier in ("device", "host")}
        for worker in cluster.workers:
            with WorkerClient(worker.target) as client:
                statuses, _base = client.list_adapters()
            for status in statuses:
                tier = {"device": "device", "host": "host", "loading": "host"}.get(
                    status.residency)
                if tier is not None:
                    counts[(worker.target, tier)] += 1
        return counts

    def exported() -> dict[tuple[str, str], int]:
        metrics = _metrics(cluster)
        return {key: int(_value(metrics, "lorastream_gateway_worker_adapters",
                                worker=key[0], tier=key[1])) for key in truth()}

    assert wait_until(lambda: exported() == truth() and sum(truth().values()) >= 1), (
        exported(), truth())


def _model_labels(metrics: str) -> set[str]:
    """Every ``model`` label value of the per-model series."""
    return {m for m in re.findall(r'^lorastream_gateway_\w+\{[^}]*model="([^"]*)"', metrics,
                                  flags=re.MULTILINE)}


def test_per_model_series_are_bounded_to_the_busiest_n_and_the_rest_is_other(
    cluster_factory: ClusterFactory,
) -> None:
    """N = 1: attn-r4 (1 request) holds the label until mlp-r8 surely had more than 5/4 of its
    requests; from then on attn-r4's series are gone and new requests for it count as other."""
    small = cluster_factory(workers=1, metrics_adapter_labels=1)
    client = small.gateway.openai()

    def ask(model: str) -> None:
        client.completions.create(model=model, prompt="Hi", max_tokens=2,
                                  extra_body={"ignore_eos": True})

    ask("attn-r4")
    assert _model_labels(_metrics(small)) == {"attn-r4"}
    ask("mlp-r8")  # 1 is not > 5/4 * 1: other
    assert _model_labels(_metrics(small)) == {"attn-r4", "other"}
    ask("mlp-r8")  # 2 > 5/4 * 1: takes the label
    ask("attn-r4")  # now other
    metrics = _metrics(small)
    assert _model_labels(metrics) == {"mlp-r8", "other"}
    assert _value(metrics, "lorastream_gateway_model_requests_total", model="mlp-r8") == 1
    assert _value(metrics, "lorastream_gateway_model_requests_total", model="other") == 2
    assert _value(metrics, "lorastream_gateway_ttft_seconds_count", model="other") == 2
    assert _value(metrics, "lorastream_gateway_generated_tokens_total", model="mlp-r8") == 2
