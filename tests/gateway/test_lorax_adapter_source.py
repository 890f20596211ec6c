"""Issue 23 item 3: LoRAX's ``adapter_source`` is honoured when the adapter named by
``adapter_id`` is staged from a source of that kind, else a 400 naming ``adapter_source``; never
ignored. One adapter comes from a real (test) Hugging Face Hub server, the others from local
paths, through the official ``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.gateway.conftest import BASE, TOKEN, Cluster, ClusterFactory
from tests.support.hub_server import HubServer

HUB_REPO = "org/lorax-mlp"


@pytest.fixture(scope="module")
def lorax(
    cluster_factory: ClusterFactory, tiny_adapters: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    """One worker; the store reaches the test Hub, where ``org/lorax-mlp`` holds mlp-r8's files,
    staged under the name ``org/lorax-mlp`` (as a LoRAX user names it)."""
    with HubServer() as hub, pytest.MonkeyPatch.context() as env:
        env.setenv("LORASTREAM_STORE_HF_ENDPOINT", hub.url)
        env.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf-home")))
        for name in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE", "HUGGING_FACE_HUB_TOKEN"):
            env.delenv(name, raising=False)
        hub.publish(HUB_REPO, tiny_adapters["mlp-r8"])
        cluster = cluster_factory(workers=1)
        with cluster.gateway.http(TOKEN) as http:
            response = http.post("/v1/adapters", json={"name": HUB_REPO,
                                                       "source": f"hf://{HUB_REPO}"})
        assert response.status_code == 201, response.text
        yield cluster


def _chat(cluster: Cluster, **extra: object) -> str:
    reply = cluster.gateway.openai().chat.completions.create(
        model=str(extra.pop("model", BASE)), messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4, temperature=0, extra_body=extra or None,
    )
    return reply.choices[0].message.content or ""


@pytest.mark.parametrize(("adapter_id", "source", "same_as"), [
    (HUB_REPO, "hub", "mlp-r8"),
    ("attn-r4", "local", "attn-r4"),
], ids=["hub", "local"])
def test_a_consistent_adapter_source_is_honoured(
    lorax: Cluster, adapter_id: str, source: str, same_as: str
) -> None:
    answer = _chat(lorax, adapter_id=adapter_id, adapter_source=source)
    assert answer == _chat(lorax, model=same_as) != _chat(lorax)


@pytest.mark.parametrize(("extra", "param"), [
    ({"adapter_id": HUB_REPO, "adapter_source": "local"}, "adapter_source"),
    ({"adapter_id": "attn-r4", "adapter_source": "hub"}, "adapter_source"),
    ({"adapter_id": "attn-r4", "adapter_source": "s3"}, "adapter_source"),
    ({"adapter_id": "attn-r4", "adapter_source": "pbase"}, "adapter_source"),
    ({"adapter_id": "attn-r4", "adapter_source": "github"}, "adapter_source"),
    ({"model": "attn-r4", "adapter_source": "local"}, "adapter_source"),  # no adapter_id
    ({"adapter_id": BASE, "adapter_source": "hub"}, "adapter_source"),
], ids=["hub-as-local", "local-as-hub", "local-as-s3", "pbase", "unknown-kind", "no-adapter-id",
        "base-model"])
def test_an_inconsistent_adapter_source_is_a_400_naming_it(
    lorax: Cluster, extra: dict[str, str], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(lorax, **extra)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error


def test_an_unknown_adapter_with_a_source_is_a_404(lorax: Cluster) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        _chat(lorax, adapter_id="org/not-staged", adapter_source="hub")
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "adapter_id", error
