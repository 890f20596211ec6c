"""Prefix caching seen from the OpenAI API: ``usage.prompt_tokens_details.cached_tokens`` (as
OpenAI and vLLM report it) through the worker's gRPC stream and the gateway, whole and
streamed."""

from __future__ import annotations

import pytest

from tests.gateway.conftest import BASE, TOKEN, Cluster, ClusterFactory

SYSTEM = "You answer questions about the weather in a calm, even, friendly tone. " * 2


@pytest.fixture(scope="module")
def one_worker(cluster_factory: ClusterFactory) -> Cluster:
    return cluster_factory(workers=1)


@pytest.mark.parametrize("model", [BASE, "attn-r4"])
def test_a_repeated_system_prompt_reports_its_cached_tokens(
    one_worker: Cluster, model: str
) -> None:
    client = one_worker.gateway.openai()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": model}]
    replies = [
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=4, temperature=0,  # type: ignore[arg-type]
        )
        for _ in range(2)
    ]
    first, second = (r.usage for r in replies)
    assert first is not None and second is not None
    assert first.prompt_tokens_details is not None and second.prompt_tokens_details is not None
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = second.prompt_tokens_details.cached_tokens
    assert cached is not None and len(SYSTEM) <= cached < second.prompt_tokens
    assert cached % 16 == 0  # whole KV blocks
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


def test_streamed_usage_reports_cached_tokens(one_worker: Cluster) -> None:
    client = one_worker.gateway.openai()
    prompt = SYSTEM + "Tomorrow?"
    client.completions.create(model=BASE, prompt=prompt, max_tokens=2, temperature=0)
    chunks = list(client.completions.create(
        model=BASE, prompt=prompt, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16


def test_the_operator_reset_empties_every_workers_prefix_cache(one_worker: Cluster) -> None:
    client = one_worker.gateway.openai()
    prompt = SYSTEM + "Reset?"

    def cached() -> int:
        reply = client.completions.create(model=BASE, prompt=prompt, max_tokens=1, temperature=0)
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return int(reply.usage.prompt_tokens_details.cached_tokens or 0)

    cached()
    assert cached() > 0
    assert one_worker.gateway.http().post("/v1/prefix-cache/reset").status_code == 401
    reply = one_worker.gateway.http(TOKEN).post("/v1/prefix-cache/reset")
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"reset": [one_worker.workers[0].target], "errors": {}}
    assert cached() == 0
