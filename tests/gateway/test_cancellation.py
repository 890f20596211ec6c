"""A client that goes away cancels its worker request; deadlines turn into 504s, never hangs."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.conftest import BASE, Cluster, ClusterFactory, wait_until

LONG = 1500  # tokens: ~2 s of decoding on the tiny model, far longer than any cancellation takes


def _long_request(stream: bool) -> dict[str, object]:
    return {"model": "attn-r4", "prompt": "Hi", "max_tokens": LONG, "ignore_eos": True,
            "stream": stream}


def _all_idle(cluster: Cluster) -> bool:
    pool = cluster.gateway.state.pool
    return all(w.idle() for w in cluster.workers) and all(
        w.inflight == 0 for w in pool.workers.values())


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_going_away_cancels_the_worker_request(cluster: Cluster, stream: bool) -> None:
    generated = sum(w.generated() for w in cluster.workers)
    with cluster.gateway.http() as http:
        if stream:
            with http.stream("POST", "/v1/completions", json=_long_request(True)) as response:
                assert response.status_code == 200
                first = next(response.iter_lines())
                assert first.startswith("data: ")
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=_long_request(False), timeout=0.5)
    assert wait_until(lambda: _all_idle(cluster), 5)
    assert sum(w.generated() for w in cluster.workers) - generated < LONG


def test_a_generation_past_the_deadline_is_504(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(workers=1, request_timeout_s=0.3)
    with cluster.gateway.http() as http:
        whole = http.post("/v1/completions", json=_long_request(False))
        with http.stream("POST", "/v1/completions", json=_long_request(True)) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        quick = http.post("/v1/completions", json={"model": BASE, "prompt": "x", "max_tokens": 2})
    assert whole.status_code == 504 and whole.json()["error"]["type"] == "timeout"
    # The stream had started: the deadline arrives as an error event, then [DONE] ends it.
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "timeout"
    assert lines[-1] == "data: [DONE]"
    assert quick.status_code == 200
    assert wait_until(lambda: _all_idle(cluster), 5)


def test_every_healthy_worker_full_is_429_with_retry_after(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(workers=1, max_requests_per_worker=1)
    with (
        cluster.gateway.http() as http,
        cluster.gateway.http() as second,
        http.stream("POST", "/v1/completions", json=_long_request(True)) as response,
    ):
        lines = response.iter_lines()  # kept: a discarded iterator closes the connection
        next(lines)
        refused = second.post("/v1/completions", json={"model": BASE, "prompt": "x"})
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "capacity_exhausted"
    assert refused.headers["retry-after"] == "1"
