"""Issue 28 at the gateway: inference API keys, adapter sources only for operators (finding 7),
and the operate token carried to the workers, whose load/unload refuse anyone else."""

from __future__ import annotations

import openai
import pytest

from lorastream.core import errors
from lorastream.core.worker_client import WorkerClient
from tests.gateway.conftest import STORED_ADAPTERS, TOKEN, Cluster, ClusterFactory

KEY = "inference-key-1"


@pytest.fixture(scope="module")
def keyed(cluster_factory: ClusterFactory) -> Cluster:
    """One worker with the operate token; a gateway with it and one API key."""
    return cluster_factory(workers=1, worker_overrides={"token": TOKEN}, api_keys=[KEY])


def _chat(cluster: Cluster, api_key: str) -> int:
    with cluster.gateway.http(api_key or None) as http:
        return http.post("/v1/chat/completions", json={
            "model": "attn-r4", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        }).status_code


@pytest.mark.parametrize(("api_key", "status"), [
    ("", 401), ("wrong", 401), (KEY, 200), (TOKEN, 200),
], ids=["anonymous", "wrong", "api-key", "operate-token"])
def test_with_api_keys_the_openai_endpoints_need_one(
    keyed: Cluster, api_key: str, status: int
) -> None:
    assert _chat(keyed, api_key) == status
    with keyed.gateway.http(api_key or None) as http:
        assert http.get("/v1/models").status_code == status
        assert http.get("/health").status_code == 200  # probes need no key


def test_the_openai_client_sends_its_api_key(keyed: Cluster) -> None:
    with pytest.raises(openai.AuthenticationError):
        keyed.gateway.openai().models.list()  # api_key="unused"
    client = openai.OpenAI(base_url=f"{keyed.gateway.url}/v1", api_key=KEY, max_retries=0)
    assert {m.id for m in client.models.list()} >= set(STORED_ADAPTERS)
    client.close()


@pytest.mark.parametrize(("token", "shown"), [(KEY, False), (TOKEN, True)],
                         ids=["api-key", "operate-token"])
def test_models_show_adapter_sources_only_to_the_operate_token(
    keyed: Cluster, token: str, shown: bool
) -> None:
    """Finding 7: /v1/models showed every adapter's source URI (paths, buckets) to anyone."""
    with keyed.gateway.http(token) as http:
        listed = [m for m in http.get("/v1/models").json()["data"] if m["id"] in STORED_ADAPTERS]
        one = http.get(f"/v1/models/{STORED_ADAPTERS[0]}").json()
    assert listed and all(("source" in m["metadata"]) is shown for m in listed)
    assert ("source" in one["metadata"]) is shown


def test_an_api_key_is_not_an_operator(keyed: Cluster) -> None:
    with keyed.gateway.http(KEY) as http:
        assert http.get("/v1/adapters").status_code == 401
        assert http.delete(f"/v1/adapters/{STORED_ADAPTERS[0]}").status_code == 401


def test_the_gateway_loads_into_workers_with_their_token_and_others_cannot(
    keyed: Cluster,
) -> None:
    with keyed.gateway.http(TOKEN) as http:
        response = http.post(f"/v1/adapters/{STORED_ADAPTERS[0]}/load", json={"workers": "all"})
    assert response.status_code == 200, response.text
    (worker,) = keyed.workers
    with WorkerClient(worker.target) as anonymous, pytest.raises(errors.Unauthenticated):
        anonymous.unload_adapter(STORED_ADAPTERS[0])
