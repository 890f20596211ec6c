"""Weighted mixes of adapters through the gateway: the ``lora`` field (llama.cpp's ``name`` or
``id`` keys) and the ``mix:`` model spelling on completions and chat completions give what the
worker gives for the same mix, and every refusal is a clear 4xx naming its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from lorastream.core.generation import PromptInput
from lorastream.core.store_client import StoreClient
from tests.gateway.conftest import BASE, Cluster, ClusterFactory, worker_greedy
from tests.support.models import ATTENTION, make_peft_adapter

PROMPT = "The capital of France is"
MIX = "mix:attn-r4=0.7,mlp-r8=0.6"  # the canonical spelling of the mix below
LORA = [{"name": "attn-r4", "scale": 0.7}, {"id": "mlp-r8", "scale": 0.6}]
LIMIT = 2


@pytest.fixture(scope="module")
def mix_cluster(
    cluster_factory: ClusterFactory, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Cluster:
    """One worker (2 slots) mixing at most 2 adapters; the store also holds a DoRA adapter."""
    cluster = cluster_factory(workers=1, worker_overrides={"max_mix_adapters": LIMIT})
    dora = make_peft_adapter(tiny_model, tmp_path_factory.mktemp("dora") / "dora", rank=4,
                             targets=ATTENTION, use_dora=True)
    with StoreClient(cluster.store) as client:
        for _ in client.preload(str(dora), "dora-attn"):
            pass
    return cluster


def _complete(http: httpx.Client, chat: bool, **body: Any) -> httpx.Response:
    payload: dict[str, Any] = {"max_tokens": 8, "temperature": 0, **body}
    if chat:
        return http.post("/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": PROMPT}], **payload})
    return http.post("/v1/completions", json={"prompt": PROMPT, **payload})


def _text(reply: dict[str, Any], chat: bool) -> str:
    choice = reply["choices"][0]
    return str(choice["message"]["content"] if chat else choice["text"])


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_lora_field_and_the_model_spelling_serve_the_workers_mix(
    mix_cluster: Cluster, chat: bool
) -> None:
    target = mix_cluster.workers[0].target
    prompt = (PromptInput(messages=(("user", PROMPT),)) if chat else PromptInput(text=PROMPT))
    expected, _ = worker_greedy(target, MIX, prompt, 8)
    alone = {name: worker_greedy(target, name, prompt, 8)[0] for name in ("attn-r4", "mlp-r8")}
    assert all(text != expected for text in alone.values())  # the mix is neither component
    with mix_cluster.gateway.http() as http:
        by_field = _complete(http, chat, model=BASE, lora=LORA)
        by_model = _complete(http, chat, model="mix:attn-r4=0.7, mlp-r8=0.60")
    for reply in (by_field, by_model):
        assert reply.status_code == 200, reply.text
        assert (_text(reply.json(), chat), reply.json()["model"]) == (expected, MIX)


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        ({"model": BASE, "lora": [{"name": "ghost", "scale": 1}]}, 404, "lora", "ghost"),
        ({"model": "mix:attn-r4=1,ghost=1"}, 404, "model", "ghost"),
        ({"model": BASE, "lora": [{"name": n, "scale": 1}
                                  for n in ("attn-r4", "mlp-r8", "all-r16-rslora")]},
         400, "lora", "at most 2"),
        ({"model": "mix:attn-r4=1,attn-r4=2"}, 400, "model", "more than once"),
        ({"model": "mix:attn-r4=inf"}, 400, "model", "finite"),
        ({"model": "mix:attn-r4"}, 400, "model", "<adapter>=<weight>"),
        ({"model": BASE, "lora": [{"name": "attn-r4", "scale": "NaN"}]}, 400, "lora", "finite"),
        ({"model": "attn-r4", "lora": LORA}, 400, "lora", "base model"),
        ({"model": BASE, "lora": [{"name": "dora-attn", "scale": 1}, LORA[0]]}, 400, "lora",
         "'dora-attn' cannot be part of a weighted mix: it is a DoRA adapter"),
    ],
    ids=["unknown-in-lora", "unknown-in-model", "over-the-limit", "duplicate", "infinite",
         "no-weight", "nan", "lora-with-an-adapter-model", "dora"],
)
def test_a_bad_mix_is_a_clear_4xx_naming_its_field(
    mix_cluster: Cluster, body: dict[str, Any], status: int, param: str, says: str
) -> None:
    with mix_cluster.gateway.http() as http:
        reply = _complete(http, False, **body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and says in error["message"], error
    if status == 404:
        assert error["code"] == "model_not_found"
    engine = mix_cluster.workers[0].engine
    assert engine.adapters.usage().references == 0  # nothing held by a refused request
