"""The official ``openai`` client against the gateway (real uvicorn, real workers, real store)."""

from __future__ import annotations

import functools
import math
from typing import Any

import openai
import pytest

from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.core.worker_client import WorkerClient
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
        model=model, messages=CHAT, max_tokens=10, temperature=0  # type: ignore[arg-type]  # plain dicts, not openai's TypedDicts
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
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model="attn-r4", messages=CHAT, max_tokens=12, temperature=0,
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
    meta, parent = adapter.metadata, adapter.parent  # type: ignore[attr-defined]  # fields the server adds to openai's Model
    assert (meta["rank"], meta["use_rslora"], parent) == (16, True, BASE)
    assert set(meta["target_modules"]) >= {"q_proj", "down_proj"}
    assert "source" not in meta and meta["pinned"] is False  # sources: operators only
    with cluster.gateway.http(TOKEN) as operator:
        listed = {m["id"]: m for m in operator.get("/v1/models").json()["data"]}
    assert listed["all-r16-rslora"]["metadata"]["source"].endswith("all-r16-rslora")
    assert adapter.created > 0 and adapter.owned_by == "lorastream"
    assert client.models.retrieve("attn-r4").metadata["rank"] == 4  # type: ignore[attr-defined]  # fields the server adds to openai's Model
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
        ({"n": 17}, "n"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 200}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),  # outside the worker's vocabulary
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"min_tokens": -1}}, "min_tokens"),
        ({"extra_body": {"min_tokens": 9}, "max_tokens": 4}, "min_tokens"),
        ({"extra_body": {"stop_token_ids": [100000]}}, "stop_token_ids"),
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "!"}, "suffix"),
        ({"extra_body": {"adapter_source": "hub"}}, "adapter_source"),
        ({"extra_body": {"adapter_id": "mlp-r8"}}, "adapter_id"),  # model names another adapter
        ({"prompt": "x" * 3000}, "prompt"),  # longer than the 2048-token context
        # vLLM's extras this server does not implement: refused, never ignored
        ({"extra_body": {"min_p": 0.1}}, "min_p"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
        ({"extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
        ({"extra_body": {"allowed_token_ids": [5]}}, "allowed_token_ids"),
        ({"extra_body": {"bad_words": ["x"]}}, "bad_words"),
        ({"extra_body": {"include_stop_str_in_output": True}}, "include_stop_str_in_output"),
        ({"extra_body": {"skip_special_tokens": False}}, "skip_special_tokens"),
        ({"extra_body": {"guided_regex": "a+"}}, "guided_regex"),
    ],
)
def test_bad_parameters_are_bad_request_errors_naming_the_field(
    cluster: Cluster, params: dict[str, object], param: str | None
) -> None:
    request = {"model": "attn-r4", "prompt": "Hello", **params}
    with pytest.raises(openai.BadRequestError) as caught:
        cluster.gateway.openai().completions.create(**request)  # type: ignore[call-overload]  # request: a plain dict of the call's arguments
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: never silently ignored
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"n": 0}, "n"),
        ({"extra_body": {"chat_template": "{{ messages }}"}}, "chat_template"),
        ({"extra_body": {"continue_final_message": True}}, "continue_final_message"),
        ({"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
         "chat_template_kwargs"),
    ],
)
def test_unsupported_chat_fields_are_refused_naming_the_field(
    cluster: Cluster, params: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        cluster.gateway.openai().chat.completions.create(
            model="attn-r4", messages=CHAT, max_tokens=2, **params
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error


def test_tool_choice_none_logprobs_false_and_neutral_extras_are_accepted(cluster: Cluster) -> None:
    reply = cluster.gateway.openai().chat.completions.create(
        model="attn-r4", messages=CHAT, max_tokens=2, tool_choice="none",
        logprobs=False, extra_body={"min_p": 0.0, "skip_special_tokens": True,
                                    "add_generation_prompt": True},
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
    text, _tokens = worker_greedy(cluster.workers[0].target, "attn-r4",
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
        client.chat.completions.create(model=BASE, messages=image)  # type: ignore[arg-type]  # a message openai's types refuse, on purpose
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello!"}]}]
    reply = client.chat.completions.create(
        model=BASE, messages=parts, max_completion_tokens=3  # type: ignore[arg-type]  # plain dicts, not openai's TypedDicts
    )
    assert reply.usage.completion_tokens <= 3


# -- sampling parameters ----------------------------------------------------------------------
PROMPT = "The capital of France is"
EOS = 2  # the tiny tokenizer's </s>
FLOOR = -9999.0  # what vLLM sends for a -inf logprob


def _worker_tokens(cluster: Cluster, model: str, prompt: PromptInput,
                   params: SamplingParams) -> tuple[str, int, str | None]:
    """(text, completion tokens, finish reason) of the same request asked of a worker directly."""
    with WorkerClient(cluster.workers[0].target) as client:
        events = list(client.generate(model, prompt, params))
    reason = events[-1].finish_reason
    return ("".join(e.text for e in events), events[-1].completion_tokens,
            reason.value if reason is not None else None)


# (OpenAI client kwargs, the same as SamplingParams fields, what proves it acted)
SAMPLING_CASES = [
    ({"presence_penalty": -2.0, "frequency_penalty": 0.5},
     {"presence_penalty": -2.0, "frequency_penalty": 0.5}, "changes"),
    ({"extra_body": {"repetition_penalty": 0.2}}, {"repetition_penalty": 0.2}, "changes"),
    ({"logit_bias": {"70": 9.0}}, {"logit_bias": ((70, 9.0),)}, "changes"),
    ({"logit_bias": {str(EOS): 40}, "extra_body": {"min_tokens": 5}},
     {"logit_bias": ((EOS, 40.0),), "min_tokens": 5}, "stops after 5"),
    ({"logit_bias": {str(EOS): 40}, "extra_body": {"ignore_eos": True}},
     {"logit_bias": ((EOS, 40.0),), "ignore_eos": True}, "runs to max_tokens"),
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("kwargs", "fields", "proof"), SAMPLING_CASES,
                         ids=["presence-frequency", "repetition", "logit-bias", "min-tokens",
                              "ignore-eos"])
def test_sampling_parameters_reach_the_worker_and_act(
    cluster: Cluster, chat: bool, stream: bool, kwargs: dict[str, Any], fields: dict[str, Any],
    proof: str,
) -> None:
    client = cluster.gateway.openai()
    common: dict[str, Any] = {"model": "mlp-r8", "max_tokens": 10, "temperature": 0}
    if chat:
        prompt = PromptInput(messages=tuple((m["role"], m["content"]) for m in CHAT))
        create: Any = functools.partial(client.chat.completions.create, messages=CHAT)
    else:
        prompt = PromptInput(text=PROMPT)
        create = functools.partial(client.completions.create, prompt=PROMPT)
    if stream:
        chunks = list(create(**common, **kwargs, stream=True,
                             stream_options={"include_usage": True}))
        pieces = [c.choices[0] for c in chunks if c.choices]
        text = "".join((p.delta.content or "") if chat else p.text for p in pieces)
        tokens, reason = chunks[-1].usage.completion_tokens, pieces[-1].finish_reason
    else:
        reply = create(**common, **kwargs)
        choice = reply.choices[0]
        text = choice.message.content if chat else choice.text
        tokens, reason = reply.usage.completion_tokens, choice.finish_reason
    expected = _worker_tokens(cluster, "mlp-r8", prompt, SamplingParams(max_tokens=10, **fields))
    assert (text, tokens, reason) == expected
    plain = _worker_tokens(cluster, "mlp-r8", prompt, SamplingParams(max_tokens=10))
    if proof == "changes":
        assert text != plain[0]
    elif proof == "stops after 5":
        assert (tokens, reason) == (6, "stop")  # 5 tokens, then the (biased) EOS
    else:
        assert (tokens, reason) == (10, "length")


def test_stop_token_ids_end_the_completion_at_that_token(cluster: Cluster) -> None:
    with WorkerClient(cluster.workers[0].target) as worker:
        free = [t for e in worker.generate(BASE, PromptInput(text="abc"),
                                           SamplingParams(max_tokens=12, ignore_eos=True))
                for t in e.token_ids]
    stop_id = free[4]
    cut = cluster.gateway.openai().completions.create(
        model=BASE, prompt="abc", max_tokens=12, temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens == free.index(stop_id) + 1  # the stop token is counted


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("k", [0, 3])
def test_completion_logprobs_have_openais_shape_and_the_greedy_token_is_the_most_likely(
    cluster: Cluster, stream: bool, k: int
) -> None:
    client = cluster.gateway.openai()
    request: dict[str, Any] = {"model": "attn-r4", "prompt": PROMPT, "max_tokens": 8,
                               "temperature": 0, "logprobs": k,
                               "extra_body": {"ignore_eos": True, "repetition_penalty": 1.3}}
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(**request, stream=True)]
        text = "".join(c.text for c in chunks)
        tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        token_lps = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
        tops = [d for c in chunks if c.logprobs for d in c.logprobs.top_logprobs]
        offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    else:
        choice = client.completions.create(**request).choices[0]
        assert choice.logprobs is not None
        text, tokens = choice.text, choice.logprobs.tokens
        token_lps, tops = choice.logprobs.token_logprobs, choice.logprobs.top_logprobs
        offsets = choice.logprobs.text_offset
    assert len(tokens) == len(token_lps) == len(tops) == 8 and "".join(tokens) == text
    assert offsets == [len("".join(tokens[:i])) for i in range(8)]
    for token, lp, top in zip(tokens, token_lps, tops, strict=True):
        assert lp <= 0 and top[token] == lp
        assert len(top) == max(k, 1)  # the top k, plus the sampled token (here one of them)
        assert lp == max(top.values())  # greedy: the sampled token is the most likely


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_with_top_logprobs_match_the_workers_and_the_greedy_token_is_the_max(
    cluster: Cluster, stream: bool
) -> None:
    client = cluster.gateway.openai()
    request: dict[str, Any] = {"model": "all-r16-rslora", "messages": CHAT, "max_tokens": 6,
                               "temperature": 0, "logprobs": True, "top_logprobs": 4,
                               "presence_penalty": 1.0}
    if stream:
        chunks = [c.choices[0] for c in client.chat.completions.create(**request, stream=True)
                  if c.choices]
        entries = [e for c in chunks if c.logprobs for e in c.logprobs.content or []]
    else:
        choice = client.chat.completions.create(**request).choices[0]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        entries = choice.logprobs.content
    prompt = PromptInput(messages=tuple((m["role"], m["content"]) for m in CHAT))
    with WorkerClient(cluster.workers[0].target) as worker:
        events = list(worker.generate("all-r16-rslora", prompt, SamplingParams(
            max_tokens=6, logprobs=4, presence_penalty=1.0)))
    expected = [lp for e in events for lp in e.logprobs]
    assert [e.token for e in entries] == [lp.token for lp in expected]
    for entry, lp in zip(entries, expected, strict=True):
        assert entry.logprob == pytest.approx(lp.logprob, abs=1e-6)
        assert entry.bytes == list(entry.token.encode())
        assert [t.token for t in entry.top_logprobs] == [t.token for t in lp.top]
        assert len(entry.top_logprobs) == 4
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_token_masked_by_a_constraint_gets_the_finite_floor_logprob(
    cluster: Cluster, chat: bool
) -> None:
    """JSON has no -inf: a top logprob of a masked token is sent as -9999.0, as vLLM does.

    A choice of "yes" or "no" masks every other token of the 256-token vocabulary, so 18 of the
    top 20 logprobs of the first token are -inf at the worker and must reach the client floored.
    """
    client = cluster.gateway.openai()
    common: dict[str, Any] = {"model": BASE, "max_tokens": 3, "temperature": 0,
                              "extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}
    if chat:
        reply = client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=20,
                                               **common)
        content = reply.choices[0].logprobs.content  # type: ignore[union-attr]  # asked for
        first = {t.token: t.logprob for t in content[0].top_logprobs}  # type: ignore[index]  # asked for
    else:
        completion = client.completions.create(prompt=PROMPT, logprobs=20, **common)
        first = completion.choices[0].logprobs.top_logprobs[0]  # type: ignore[union-attr,index]  # asked for
    finite = {token for token, lp in first.items() if lp > FLOOR}
    assert finite == {"y", "n"}  # the tiny tokenizer: one character per token
    assert len(first) == 20 and all(math.isfinite(lp) for lp in first.values())
    assert sorted(lp for lp in first.values() if lp <= FLOOR) == [FLOOR] * 18


# -- n > 1 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n_greedy_choices_each_equal_the_n_1_reply(
    cluster: Cluster, chat: bool, stream: bool
) -> None:
    client = cluster.gateway.openai()
    common: dict[str, Any] = {"model": "attn-r4", "max_tokens": 9, "temperature": 0,
                              "logprobs": True if chat else 2}
    if chat:
        common |= {"messages": CHAT, "top_logprobs": 2}
        create: Any = client.chat.completions.create
    else:
        common |= {"prompt": PROMPT}
        create = client.completions.create
    one = create(**common)
    if stream:
        chunks = list(create(**common, n=3, stream=True, stream_options={"include_usage": True}))
        texts, reasons, roles = ["", "", ""], [None, None, None], 0
        for chunk in chunks[:-1]:
            choice = chunk.choices[0]
            if chat and choice.delta.role == "assistant":
                roles += 1
            texts[choice.index] += (choice.delta.content or "") if chat else choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        usage = chunks[-1].usage
        assert roles == (3 if chat else 0)
    else:
        reply = create(**common, n=3)
        assert [c.index for c in reply.choices] == [0, 1, 2]
        texts = [c.message.content if chat else c.text for c in reply.choices]
        reasons = [c.finish_reason for c in reply.choices]
        usage = reply.usage
        for c in reply.choices:  # the same logprobs, up to batch-layout rounding
            assert _token_logprobs(c, chat) == pytest.approx(
                _token_logprobs(one.choices[0], chat), abs=1e-4)
    want = one.choices[0].message.content if chat else one.choices[0].text
    assert texts == [want] * 3
    assert reasons == [one.choices[0].finish_reason] * 3
    assert usage.prompt_tokens == one.usage.prompt_tokens
    assert usage.completion_tokens == 3 * one.usage.completion_tokens


def test_seeded_choice_i_equals_a_request_with_seed_plus_i(cluster: Cluster) -> None:
    client = cluster.gateway.openai()
    common: dict[str, Any] = {"model": BASE, "prompt": PROMPT, "max_tokens": 10,
                              "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    reply = client.completions.create(**common, n=3, seed=11)
    alone = [client.completions.create(**common, seed=11 + i).choices[0].text for i in range(3)]
    assert [c.text for c in reply.choices] == alone
    assert len(set(alone)) > 1


def _token_logprobs(choice: Any, chat: bool) -> dict[str, float]:
    """position:token -> logprob of a choice's sampled tokens."""
    assert choice.logprobs is not None
    if chat:
        pairs = [(e.token, e.logprob) for e in choice.logprobs.content]
    else:
        pairs = list(zip(choice.logprobs.tokens, choice.logprobs.token_logprobs, strict=True))
    return {f"{i}:{token}": lp for i, (token, lp) in enumerate(pairs)}
