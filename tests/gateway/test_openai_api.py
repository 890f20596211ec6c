"""The official ``openai`` client against the gateway (real uvicorn, real workers, real store)."""

from __future__ import annotations

import openai
import pytest

from lorastream.core.generation import PromptInput
from tests.gateway.conftest import BASE, STORED_ADAPTERS, TOKEN, Cluster, worker_greedy

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]


@pytest.mark.parametrize("model", [BASE, "attn-r4", "all-r16-rslora"])
def test_greedy_completion_equals_the_workers_own_output(cluster: Cluster, model: str) -> None:
    reply = cluster.gateway.openai().completions.create(
        model=model, prompt="The capital of France is", max_tokens=12, temperature=0
    )
    text, tokens = worker_greedy(cluster.workers[0].target, model,
                                 PromptInput(text="The capital of France is"), 12)
    choice = reply.choices[0]
    assert (choice.text, reply.usage.completion_tokens) == (text, tokens)
    assert reply.object == "text_completion" and reply.model == model
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + tokens


@pytest.mark.parametrize("model", [BASE, "mlp-r8"])
def test_greedy_chat_uses_the_chat_template_and_equals_the_worker(
    cluster: Cluster, model: str
) -> None:
    reply = cluster.gateway.openai().chat.completions.create(
        model=model, messages=CHAT, max_tokens=10, temperature=0  # type: ignore[arg-type]
    )
    messages = tuple((m["role"], m["content"]) for m in CHAT)
    text, tokens = worker_greedy(cluster.workers[1].target, model,
                                 PromptInput(messages=messages), 10)
    assert reply.choices[0].message.role == "assistant"
    assert (reply.choices[0].message.content, reply.usage.completion_tokens) == (text, tokens)
    assert reply.object == "chat.completion"


def test_token_id_prompts_and_single_item_lists_are_accepted(cluster: Cluster) -> None:
    client = cluster.gateway.openai()
    as_text = client.completions.create(model="attn-r4", prompt=["Hi"], max_tokens=6,
                                        temperature=0)
    ids = [ord(c) - 32 + 3 for c in "Hi"]  # the tiny tokenizer: printable ASCII from id 3
    as_ids = client.completions.create(model="attn-r4", prompt=ids, max_tokens=6, temperature=0)
    assert as_text.choices[0].text == as_ids.choices[0].text
    assert as_text.usage.prompt_tokens == as_ids.usage.prompt_tokens == 2


@pytest.mark.parametrize("include_usage", [False, True])
def test_streamed_completion_concatenates_to_the_whole_one(
    cluster: Cluster, include_usage: bool
) -> None:
    client = cluster.gateway.openai()
    whole = client.completions.create(model="attn-r4", prompt="Once upon", max_tokens=16,
                                      temperature=0)
    chunks = list(client.completions.create(
        model="attn-r4", prompt="Once upon", max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": include_usage},
    ))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    else:
        assert all(c.usage is None for c in chunks)


def test_streamed_chat_opens_with_the_role_and_matches_the_whole_reply(cluster: Cluster) -> None:
    client = cluster.gateway.openai()
    whole = client.chat.completions.create(model="attn-r4", messages=CHAT, max_tokens=12,
                                           temperature=0)  # type: ignore[arg-type]
    chunks = list(client.chat.completions.create(
        model="attn-r4", messages=CHAT, max_tokens=12, temperature=0,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stop_strings_and_seeded_sampling_behave_like_openai(cluster: Cluster) -> None:
    client = cluster.gateway.openai()
    free = client.completions.create(model=BASE, prompt="abc", max_tokens=12, temperature=0)
    cut = free.choices[0].text[3:5]
    stopped = client.completions.create(model=BASE, prompt="abc", max_tokens=12, temperature=0,
                                        stop=cut)
    assert stopped.choices[0].text == free.choices[0].text.split(cut)[0]
    assert stopped.choices[0].finish_reason == "stop"
    seeded = [
        client.completions.create(model=BASE, prompt="abc", max_tokens=12, temperature=1.0,
                                  seed=7).choices[0].text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_models_list_has_the_base_model_and_every_stored_adapter_with_metadata(
    cluster: Cluster,
) -> None:
    client = cluster.gateway.openai()
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {BASE, *STORED_ADAPTERS}
    adapter = models["all-r16-rslora"]
    meta, parent = adapter.metadata, adapter.parent  # type: ignore[attr-defined]
    assert (meta["rank"], meta["use_rslora"], parent) == (16, True, BASE)
    assert set(meta["target_modules"]) >= {"q_proj", "down_proj"}
    assert "source" not in meta and meta["pinned"] is False  # sources: operators only
    with cluster.gateway.http(TOKEN) as operator:
        listed = {m["id"]: m for m in operator.get("/v1/models").json()["data"]}
    assert listed["all-r16-rslora"]["metadata"]["source"].endswith("all-r16-rslora")
    assert adapter.created > 0 and adapter.owned_by == "lorastream"
    assert client.models.retrieve("attn-r4").metadata["rank"] == 4  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("ghost")


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_model_is_a_not_found_error(cluster: Cluster, stream: bool) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        cluster.gateway.openai().completions.create(model="ghost", prompt="x", stream=stream)
    error = caught.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "ghost" in error["message"]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 2}, "n"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"logprobs": 2}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "!"}, "suffix"),
        ({"extra_body": {"adapter_source": "hub"}}, "adapter_source"),
        ({"extra_body": {"adapter_id": "mlp-r8"}}, "adapter_id"),  # model names another adapter
        ({"prompt": "x" * 3000}, "prompt"),  # longer than the 2048-token context
    ],
)
def test_bad_parameters_are_bad_request_errors_naming_the_field(
    cluster: Cluster, params: dict[str, object], param: str | None
) -> None:
    request = {"model": "attn-r4", "prompt": "Hello", **params}
    with pytest.raises(openai.BadRequestError) as caught:
        cluster.gateway.openai().completions.create(**request)  # type: ignore[call-overload]
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # alone, too: never silently ignored
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 3}, "n"),
    ],
)
def test_unsupported_chat_fields_are_refused_naming_the_field(
    cluster: Cluster, params: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        cluster.gateway.openai().chat.completions.create(
            model="attn-r4", messages=CHAT, max_tokens=2, **params  # type: ignore[arg-type]
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error


def test_tool_choice_none_and_logprobs_false_are_accepted(cluster: Cluster) -> None:
    reply = cluster.gateway.openai().chat.completions.create(
        model="attn-r4", messages=CHAT, max_tokens=2, tool_choice="none",  # type: ignore[arg-type]
        logprobs=False,
    )
    assert reply.usage.completion_tokens >= 1


@pytest.mark.parametrize("model", [BASE, "attn-r4"])
def test_loraxs_adapter_id_is_honoured_like_model(cluster: Cluster, model: str) -> None:
    """LoRAX clients name the adapter in ``adapter_id``: the adapter answers, never the base."""
    client = cluster.gateway.openai()
    reply = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=12, temperature=0,
        extra_body={"adapter_id": "attn-r4"},
    )
    text, tokens = worker_greedy(cluster.workers[0].target, "attn-r4",
                                 PromptInput(text="The capital of France is"), 12)
    base_text, _ = worker_greedy(cluster.workers[0].target, BASE,
                                 PromptInput(text="The capital of France is"), 12)
    assert text != base_text  # the comparison can tell the adapter from the base model
    assert (reply.choices[0].text, reply.model) == (text, "attn-r4")


def test_an_unknown_adapter_id_is_not_found_naming_adapter_id(cluster: Cluster) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        cluster.gateway.openai().completions.create(
            model=BASE, prompt="x", max_tokens=2, extra_body={"adapter_id": "ghost"}
        )
    error = caught.value.body
    assert isinstance(error, dict) and (error["param"], error["code"]) == (
        "adapter_id", "model_not_found")


def test_chat_refuses_non_text_content_and_unsupported_features(cluster: Cluster) -> None:
    client = cluster.gateway.openai()
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(openai.BadRequestError, match="text content"):
        client.chat.completions.create(model=BASE, messages=image)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="n=1"):
        client.chat.completions.create(model=BASE, messages=CHAT, n=3)  # type: ignore[arg-type]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello!"}]}]
    reply = client.chat.completions.create(
        model=BASE, messages=parts, max_completion_tokens=3  # type: ignore[arg-type]
    )
    assert reply.usage.completion_tokens <= 3
