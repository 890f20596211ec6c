"""Operator endpoints: the bearer token, preload through the store, residency, load, delete."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.gateway.conftest import STORED_ADAPTERS, TOKEN, Cluster, wait_until

OPERATOR_CALLS = [
    ("GET", "/v1/adapters", None),
    ("GET", "/v1/adapters/attn-r4", None),
    ("POST", "/v1/adapters", {"name": "x", "source": "/nowhere"}),
    ("DELETE", "/v1/adapters/attn-r4", None),
    ("POST", "/v1/adapters/attn-r4/load", None),
]


@pytest.mark.parametrize(("method", "path", "body"), OPERATOR_CALLS)
@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_api_key"),
        ({"Authorization": "Bearer wrong"}, "invalid_api_key"),
        ({"Authorization": f"Basic {TOKEN}"}, "invalid_api_key"),
        ({"Authorization": "Bearer"}, "invalid_api_key"),
    ],
)
def test_operator_endpoints_refuse_a_missing_or_wrong_token_with_401(
    cluster: Cluster, method: str, path: str, body: object, headers: dict[str, str], code: str
) -> None:
    with cluster.gateway.http() as http:
        response = http.request(method, path, json=body, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == code
    assert response.json()["error"]["type"] == "authentication_error"


def test_the_openai_endpoints_need_no_operator_token(cluster: Cluster) -> None:
    with cluster.gateway.http() as http:
        assert http.get("/v1/models").status_code == 200


def test_list_shows_every_stored_adapter_with_cache_usage(cluster: Cluster) -> None:
    with cluster.gateway.http(TOKEN) as http:
        body = http.get("/v1/adapters").json()
    assert [a["name"] for a in body["data"]] == sorted(STORED_ADAPTERS)
    assert body["cache_bytes_used"] > 0 and body["cache_bytes_budget"] > body["cache_bytes_used"]
    assert {a["name"]: a["rank"] for a in body["data"]}["mlp-r8"] == 8


def test_preload_load_describe_and_delete_an_adapter(
    cluster: Cluster, tiny_adapters: dict[str, Path]
) -> None:
    source = str(tiny_adapters["all-r64"])
    targets = [w.target for w in cluster.workers]
    with cluster.gateway.http(TOKEN) as http:
        created = http.post("/v1/adapters", json={"name": "team/r64", "source": source,
                                                  "pin": True})
        assert created.status_code == 201, created.text
        adapter = created.json()["adapter"]
        assert (adapter["name"], adapter["rank"], adapter["pinned"]) == ("team/r64", 64, True)

        loaded = http.post("/v1/adapters/team/r64/load", json={"workers": "all"}).json()
        assert sorted(r["worker"] for r in loaded["workers"]) == sorted(targets)
        assert all(r["residency"] == "device" for r in loaded["workers"]), loaded

        described = http.get("/v1/adapters/team/r64").json()
        assert described["adapter"]["source"] == source
        rows = {r["worker"]: r for r in described["workers"]}
        assert set(rows) == set(targets)
        assert all(r["residency"] == "device" and r["slot"] is not None for r in rows.values())

        deleted = http.delete("/v1/adapters/team/r64").json()
        assert deleted["deleted"] == "team/r64" and deleted["unload_errors"] == {}
        assert sorted(deleted["unloaded"]) == sorted(targets)
        assert http.get("/v1/adapters/team/r64").status_code == 404
        with cluster.gateway.http() as plain:
            reply = plain.post("/v1/completions", json={"model": "team/r64", "prompt": "x"})
        assert reply.status_code == 404
    assert wait_until(lambda: all(
        "team/r64" not in {a.name for a in w.adapters}
        for w in cluster.gateway.state.pool.workers.values()
    ))


def test_load_without_workers_goes_to_the_routing_choice_and_requests_follow_it(
    cluster: Cluster,
) -> None:
    with cluster.gateway.http(TOKEN) as http:
        loaded = http.post("/v1/adapters/mlp-r8/load").json()
        assert len(loaded["workers"]) == 1
        home = loaded["workers"][0]["worker"]
        state = cluster.gateway.state
        assert wait_until(lambda: any(a.name == "mlp-r8" and a.residency == "device"
                                      for a in state.pool.get(home).adapters))
        before = cluster.finished_counts()
        for _ in range(4):
            assert http.post("/v1/completions", json={
                "model": "mlp-r8", "prompt": "x", "max_tokens": 2}).status_code == 200
    assert cluster.serving(before)[home] == 4


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/adapters/ghost/load", {"workers": "all"}, 404, "model_not_found"),
        ("/v1/adapters/attn-r4/load", {"workers": ["10.9.9.9:1"]}, 400, "invalid_value"),
        ("/v1/adapters", {"name": "bad", "source": "relative/path"}, 400, "invalid_value"),
        ("/v1/adapters", {"name": "ghost", "source": f"{tempfile.gettempdir()}/does/not/exist"},
         404, "model_not_found"),
        ("/v1/adapters", {"name": "ghost", "source": "/does/not/exist"}, 400, "invalid_value"),
        ("/v1/adapters", {"name": "x"}, 400, "invalid_value"),
    ],
)
def test_operator_errors_are_openai_errors(
    cluster: Cluster, path: str, body: dict[str, object], status: int, code: str
) -> None:
    with cluster.gateway.http(TOKEN) as http:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


def test_preload_can_stream_its_progress(cluster: Cluster, tiny_adapters: dict[str, Path]) -> None:
    with cluster.gateway.http(TOKEN) as http:
        with http.stream("POST", "/v1/adapters", json={
            "name": "streamed", "source": str(tiny_adapters["attn-r4"]), "stream": True,
        }) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        http.delete("/v1/adapters/streamed")
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert events[-1]["phase"] == "done" and events[-1]["adapter"]["name"] == "streamed"
    assert {"resolving", "validating"} <= {e["phase"] for e in events}
