"""Two workers behind the gateway: adapters stick to their worker; a dead worker is routed around
(a request still waiting for its first token there is retried on the other) and comes back when
healthy; a worker restarted empty takes its share of the requests again."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from lorastream.gateway.async_worker_client import AsyncWorkerClient, Probe
from lorastream.worker.service.bootstrap import build_engine
from tests.gateway.conftest import (
    BASE,
    STORED_ADAPTERS,
    Cluster,
    ClusterFactory,
    WorkerHandle,
    wait_until,
)


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
    # Concurrent ones too, while the holder's queue is within the bound (2 deeper than the
    # other's by default; deeper, they spill: test_a_hot_adapter_spills_over_to_the_other_worker).
    with ThreadPoolExecutor(2) as pool:
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
    (error,) = in_flight_error  # names the worker, not an adapter source
    assert isinstance(error, openai.APIError) and isinstance(error.body, dict), error
    assert error.body.get("code") == "worker_unavailable", error.body

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


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_a_stream_cut_by_a_killed_worker_ends_with_an_error_event_then_done(
    cluster_factory: ClusterFactory, path: str, body: dict[str, object]
) -> None:
    cluster = cluster_factory(workers=1)
    (worker,) = cluster.workers
    request = {"model": "attn-r4", "max_tokens": 1500, "temperature": 0, "stream": True,
               "ignore_eos": True, **body}
    lines: list[str] = []
    with cluster.gateway.http() as http, http.stream("POST", path, json=request) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line)
            if len(lines) == 2:  # tokens are flowing (chat's first chunk is only the role)
                worker.kill()
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2].removeprefix("data: "))
    assert error["error"]["code"] == "worker_unavailable", error
    assert all("error" not in json.loads(line.removeprefix("data: ")) for line in lines[:-2])


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


def test_a_worker_killed_between_polls_is_known_down_at_once_and_no_request_fails(
    cluster_factory: ClusterFactory,
) -> None:
    """Health comes from the connection (a health Watch stream), not from polls: with polls a
    minute apart the gateway still knows within a second, and requests go to the other worker
    (at most one that raced the stream is retried there)."""
    cluster = cluster_factory(workers=2, poll_interval_s=60)  # only the first poll happens
    before = cluster.finished_counts()
    assert _complete(cluster, "attn-r4").status_code == 200
    home = cluster.worker(next(t for t, n in cluster.serving(before).items() if n == 1))
    other = next(w for w in cluster.workers if w is not home)
    home.kill()
    assert wait_until(lambda: _healthy_workers(cluster) == {other.target}, 1.5)
    moved = cluster.finished_counts()
    statuses = [_complete(cluster, "attn-r4").status_code for _ in range(4)]
    assert statuses == [200] * 4
    assert cluster.serving(moved)[other.target] == 4
    retries = cluster.gateway.state.metrics.retries.labels(home.target)._value.get()
    assert retries <= 1
    home.start()  # back on the same port: known again without a poll
    assert wait_until(lambda: _healthy_workers(cluster) == {home.target, other.target}, 3)


def test_a_worker_too_busy_to_answer_a_health_check_stays_healthy(
    cluster_factory: ClusterFactory,
) -> None:
    """Two gRPC threads, both held by long streams: a health check gets no thread and times out
    (a poll-based gateway marked such a worker down and answered 503), yet the gateway keeps the
    worker healthy, and the requests it sends meanwhile are served once a thread frees up."""
    cluster = cluster_factory(workers=1, worker_overrides={"max_workers": 2})
    (worker,) = cluster.workers
    client = cluster.gateway.openai()
    streams = [
        client.completions.create(model="attn-r4", prompt="Hi", max_tokens=1800, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
        for _ in range(2)
    ]
    for stream in streams:
        next(iter(stream))

    async def probe() -> Probe:
        probe_client = AsyncWorkerClient(worker.target)
        try:
            return await probe_client.probe(0.3)
        finally:
            await probe_client.close()

    probes: list[Probe] = []
    stop = threading.Event()

    def keep_probing() -> None:  # beside the gateway, to show the worker really is too busy
        while not stop.is_set():
            probes.append(asyncio.run(probe()))

    prober = threading.Thread(target=keep_probing)
    prober.start()
    try:
        seen = set()
        deadline = time.monotonic() + 1.5  # 15 polls at 0.1 s, each with a 0.5 s health timeout
        while time.monotonic() < deadline:
            seen.add(frozenset(_healthy_workers(cluster)))
            time.sleep(0.05)
        assert seen == {frozenset({worker.target})}
        assert _health(cluster).status_code == 200
    finally:
        stop.set()
        prober.join(timeout=10)
        for stream in streams:
            stream.close()
    assert Probe.SLOW in probes, probes  # a probe-based gateway would have seen this
    assert _complete(cluster, BASE).status_code == 200


def test_a_request_waiting_for_its_first_token_on_a_worker_that_dies_is_retried_on_another(
    cluster_factory: ClusterFactory,
) -> None:
    """A worker that runs one sequence at a time holds a second request in its queue (no event
    yet); the worker's gRPC server is stopped. The queued request is sent to the other worker
    and succeeds, invisibly to its client; only the stream already generating fails."""
    cluster = cluster_factory(workers=2, worker_overrides={"max_batch_size": 1})
    before = cluster.finished_counts()
    assert _complete(cluster, "attn-r4").status_code == 200
    home = cluster.worker(next(t for t, n in cluster.serving(before).items() if n == 1))
    other = next(w for w in cluster.workers if w is not home)
    stream = cluster.gateway.openai().completions.create(
        model="attn-r4", prompt="Hi", max_tokens=1800, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(_complete, cluster, "attn-r4", 4)
        assert wait_until(lambda: home.engine.waiting == 1), "the request did not queue at home"
        moved = cluster.finished_counts()
        home.kill()
        response = queued.result(timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert cluster.serving(moved)[other.target] == 1
    retries = cluster.gateway.state.metrics.retries.labels(home.target)._value.get()
    assert retries == 1
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in stream:
            pass


def _restart_empty(cluster: Cluster, handle: WorkerHandle) -> WorkerHandle:
    """``handle``'s worker replaced by a new process-like one on the same port: a fresh engine
    with nothing loaded (the old engine is stopped)."""
    handle.kill()
    handle.engine.stop()
    fresh = WorkerHandle(handle.settings,
                         build_engine(handle.settings, checkpoint=Path(handle.settings.model)),
                         port=handle.port)
    fresh.start()
    cluster.workers[cluster.workers.index(handle)] = fresh
    return fresh


def test_a_restarted_worker_takes_its_share_of_the_next_few_dozen_requests(
    cluster_factory: ClusterFactory,
) -> None:
    """One worker serves every adapter while the other is down; the other comes back empty.
    Of the next 32 requests (8 at a time, over the 3 adapters) it serves at least a third (half
    is its fair share), though the first worker holds every adapter (residency-first routing
    with a fixed threshold of 8 gave it none of them)."""
    cluster = cluster_factory(workers=2)
    kept, restarted = cluster.workers
    restarted.kill()
    assert wait_until(lambda: _healthy_workers(cluster) == {kept.target}, 3)
    for model in STORED_ADAPTERS:
        assert _complete(cluster, model).status_code == 200
    fresh = _restart_empty(cluster, restarted)
    try:
        assert wait_until(lambda: _healthy_workers(cluster) == {kept.target, fresh.target}, 5)
        before = cluster.finished_counts()
        models = [STORED_ADAPTERS[i % len(STORED_ADAPTERS)] for i in range(32)]
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(lambda m: _complete(cluster, m, 24).status_code, models))
        assert statuses == [200] * 32
        served = cluster.serving(before)
        assert served[fresh.target] >= 32 / 3, served
    finally:
        fresh.kill()
        fresh.engine.stop()
