"""Worker discovery: a name with several addresses is several workers, following DNS changes."""

from __future__ import annotations

import pytest

from lorastream.gateway import discovery
from lorastream.gateway.config import GatewaySettings
from lorastream.gateway.discovery import TargetResolver, pick_addresses, resolve_target
from lorastream.gateway.metrics import GatewayMetrics
from lorastream.gateway.worker_pool import WorkerPool
from tests.gateway.conftest import Cluster, start_gateway, wait_until


@pytest.mark.parametrize(
    ("addresses", "expected"),
    [
        (["127.0.0.1", "::1"], ["127.0.0.1:50052"]),  # localhost: one server, IPv4 preferred
        (["10.0.0.9", "10.0.0.10", "10.0.0.9"], ["10.0.0.9:50052", "10.0.0.10:50052"]),
        (["fd00::2", "fd00::1"], ["[fd00::1]:50052", "[fd00::2]:50052"]),
    ],
)
def test_resolved_addresses_become_one_target_each(
    addresses: list[str], expected: list[str]
) -> None:
    assert pick_addresses(addresses, 50052) == expected


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("127.0.0.1:7", ["127.0.0.1:7"]),
        ("[::1]:7", ["[::1]:7"]),
        ("localhost:7", ["127.0.0.1:7"]),
    ],
)
@pytest.mark.asyncio
async def test_ip_literals_stay_and_names_resolve(target: str, expected: list[str]) -> None:
    assert await resolve_target(target) == expected


@pytest.mark.asyncio
async def test_a_failed_lookup_keeps_the_last_answer_or_the_name() -> None:
    answers: list[list[str] | Exception] = [OSError("no DNS"), ["10.0.0.1:1"], OSError("gone")]

    async def flaky(target: str) -> list[str]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    resolver = TargetResolver(["workers:1"], flaky)
    assert await resolver.resolve() == ["workers:1"]
    assert await resolver.resolve() == ["10.0.0.1:1"]
    assert await resolver.resolve() == ["10.0.0.1:1"]


@pytest.mark.asyncio
async def test_the_pool_follows_the_resolved_workers_and_retires_busy_ones_gracefully() -> None:
    current = ["10.0.0.1:1", "10.0.0.2:1"]

    async def dns(target: str) -> list[str]:
        return list(current)

    pool = WorkerPool(["workers:1"], GatewayMetrics(), resolver=TargetResolver(["workers:1"], dns))
    assert pool.workers == {}  # nothing until the first resolution
    await pool.refresh_targets()
    assert sorted(pool.workers) == current
    pool.acquire("10.0.0.2:1", "a")  # a request in flight there
    current[:] = ["10.0.0.1:1", "10.0.0.3:1"]
    await pool.refresh_targets()
    assert sorted(pool.workers) == ["10.0.0.1:1", "10.0.0.3:1"]
    await pool._close_retired()
    assert pool.get("10.0.0.2:1").inflight == 1  # still there for its request
    pool.release("10.0.0.2:1")
    await pool._close_retired()
    with pytest.raises(KeyError):
        pool.get("10.0.0.2:1")
    await pool.close()


def test_a_name_standing_for_two_workers_makes_both_workers_and_follows_dns(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    pods = [w.target for w in cluster.workers]

    async def fake_dns(target: str) -> list[str]:
        return list(pods) if target == "gpu-worker.test:50052" else [target]

    monkeypatch.setattr(discovery, "resolve_target", fake_dns)
    gateway = start_gateway(GatewaySettings(
        workers=["gpu-worker.test:50052"], store=cluster.store, poll_interval_s=0.1,
        resolve_interval_s=0.1,
    ))
    try:
        with gateway.http() as http:
            health = http.get("/health").json()
            assert sorted(health["workers"]) == sorted(pods)
            assert all(w["healthy"] for w in health["workers"].values())
            before = cluster.finished_counts()
            for model in ("attn-r4", "mlp-r8", "all-r16-rslora", "tiny"):
                response = http.post("/v1/completions", json={
                    "model": model, "prompt": "x", "max_tokens": 1})
                assert response.status_code == 200
            assert sum(cluster.serving(before).values()) == 4
            pods[:] = pods[:1]  # one pod went away
            assert wait_until(lambda: sorted(http.get("/health").json()["workers"]) == pods)
    finally:
        gateway.stop()
