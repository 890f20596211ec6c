"""Two workers behind the gateway: adapters stick to their worker; a dead worker is routed around
and comes back when healthy."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.gateway.conftest import BASE, Cluster, ClusterFactory, wait_until


def _complete(cluster: Cluster, model: str, max_tokens: int = 3) -> httpx.Response:
    with cluster.gateway.http() as http:
        return http.post("/v1/completions", json={"model": model, "prompt": "Hi",
                                                  "max_tokens": max_tokens})


def _health(cluster: Cluster) -> httpx.Response:
    with cluster.gateway.http() as http:
        return http.get("/health")


def _healthy_workers(cluster: Cluster) -> set[str]:
    workers = _health(cluster).json()["workers"]
    return {target for target, w in workers.items() if w["healthy"]}


@pytest.mark.parametrize("model", ["attn-r4", "mlp-r8", "all-r16-rslora"])
def test_requests_for_one_adapter_stick_to_the_worker_that_holds_it(
    cluster: Cluster, model: str
) -> None:
    before = cluster.finished_counts()
    assert _complete(cluster, model).status_code == 200
    home = next(t for t, n in cluster.serving(before).items() if n == 1)
    with ThreadPoolExecutor(6) as pool:  # concurrent ones too
        statuses = list(pool.map(lambda _: _complete(cluster, model).status_code, range(6)))
    for _ in range(4):
        assert _complete(cluster, model).status_code == 200
    assert statuses == [200] * 6
    assert cluster.serving(before) == {w.target: (11 if w.target == home else 0)
                                       for w in cluster.workers}
    with cluster.gateway.http("operator-secret") as http:
        rows = http.get(f"/v1/adapters/{model}").json()["workers"]
    assert {r["worker"]: r["residency"] for r in rows}[home] == "device"


def test_a_hot_adapter_spills_over_to_the_other_worker(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(workers=2, spill_threshold=1)
    before = cluster.finished_counts()
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda _: _complete(cluster, "attn-r4", 40).status_code,
                                 range(16)))
    assert statuses == [200] * 16
    assert all(n > 0 for n in cluster.serving(before).values()), cluster.serving(before)


def test_a_killed_worker_fails_only_its_in_flight_requests_and_comes_back_when_healthy(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=2)
    before = cluster.finished_counts()
    assert _complete(cluster, "attn-r4").status_code == 200
    home = cluster.worker(next(t for t, n in cluster.serving(before).items() if n == 1))
    other = next(w for w in cluster.workers if w is not home)

    # A long stream in flight on the home worker when it dies.
    client = cluster.gateway.openai()
    stream = client.completions.create(model="attn-r4", prompt="Hi", max_tokens=1500,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    in_flight_error: list[BaseException] = []

    def drain() -> None:
        try:
            for _ in stream:
                pass
        except (openai.APIError, httpx.HTTPError) as exc:
            in_flight_error.append(exc)

    drainer = threading.Thread(target=drain)
    drainer.start()
    home.kill()
    drainer.join(timeout=10)
    assert in_flight_error, "the stream on the dead worker should end with an error"

    # New requests, sent at once (before any poll noticed), all succeed on the other worker.
    moved = cluster.finished_counts()
    with ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda m: _complete(cluster, m).status_code,
                                 ["attn-r4", "mlp-r8", BASE, "attn-r4"] * 2))
    assert statuses == [200] * 8
    assert cluster.serving(moved)[other.target] == 8
    assert _healthy_workers(cluster) == {other.target}

    home.start()  # the same port again
    assert wait_until(lambda: _healthy_workers(cluster) == {home.target, other.target}, 10)
    with cluster.gateway.http() as http:
        metrics = http.get("/metrics").text
    assert f'lorastream_gateway_worker_healthy{{worker="{home.target}"}} 1.0' in metrics


def test_health_is_503_and_requests_get_503_while_no_worker_is_healthy(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=1)
    assert _health(cluster).status_code == 200
    cluster.workers[0].kill()
    response = _complete(cluster, BASE)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_healthy_worker"
    assert response.headers["retry-after"] == "1"
    assert wait_until(lambda: _health(cluster).status_code == 503)
    assert _health(cluster).json()["status"] == "unavailable"
    cluster.workers[0].start()
    assert wait_until(lambda: _health(cluster).status_code == 200, 10)
    assert _complete(cluster, BASE).status_code == 200


def test_requests_sent_to_a_dead_worker_before_a_poll_noticed_are_retried_elsewhere(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=2, poll_interval_s=60)  # only the first poll happens
    before = cluster.finished_counts()
    assert _complete(cluster, "attn-r4").status_code == 200
    home = cluster.worker(next(t for t, n in cluster.serving(before).items() if n == 1))
    other = next(w for w in cluster.workers if w is not home)
    home.kill()
    moved = cluster.finished_counts()
    statuses = [_complete(cluster, "attn-r4").status_code for _ in range(4)]
    assert statuses == [200] * 4
    assert cluster.serving(moved)[other.target] == 4
    with cluster.gateway.http() as http:
        metrics = http.get("/metrics").text
    # Only the first request tried the dead worker: it was marked down right then.
    assert f'lorastream_gateway_worker_retries_total{{worker="{home.target}"}} 1.0' in metrics
