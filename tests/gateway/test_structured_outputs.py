"""Structured outputs through the official ``openai`` client: response_format and vLLM's
``structured_outputs``, chat and completions, whole and streamed.

The tiny model is random-weight, so what it writes is shaped only by the constraint: an output
that parses as the schema proves the constraint reached the worker's sampler.
"""

from __future__ import annotations

import functools
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from lorastream.core.generation import PromptInput
from tests.gateway.conftest import Cluster, worker_greedy
from tests.support.json_prefix import is_json_prefix

CHAT = [{"role": "user", "content": "Who are you?"}]
PROMPT = "Describe a person:"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema",
               "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def _generate(cluster: Cluster, chat: bool, stream: bool, **kwargs: Any) -> tuple[str, str]:
    """(text, finish reason) of one request, streamed or not."""
    client = cluster.gateway.openai()
    if chat:
        create: Any = functools.partial(client.chat.completions.create, messages=CHAT)
    else:
        create = functools.partial(client.completions.create, prompt=PROMPT)
    if stream:
        pieces = [c.choices[0] for c in create(**kwargs, stream=True) if c.choices]
        text = "".join((p.delta.content or "") if chat else p.text for p in pieces)
        return text, pieces[-1].finish_reason
    choice = create(**kwargs).choices[0]
    return (choice.message.content if chat else choice.text), choice.finish_reason


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("model", ["tiny", "attn-r4"])
def test_json_schema_output_parses_and_validates(
    cluster: Cluster, chat: bool, stream: bool, model: str
) -> None:
    # completions has no response_format argument in the client: it goes in the body as is
    text, reason = _generate(cluster, chat, stream, model=model, max_tokens=120, temperature=1.0,
                             seed=4, extra_body={"response_format": JSON_SCHEMA})
    jsonschema.validate(json.loads(text), PERSON)
    assert reason == "stop"  # ended when the object closed, not at max_tokens


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_json_object_output_is_a_json_object(cluster: Cluster, chat: bool) -> None:
    text, reason = _generate(cluster, chat, False, model="mlp-r8", max_tokens=60, temperature=0,
                             extra_body={"response_format": {"type": "json_object"}})
    assert text.lstrip().startswith("{"), text
    if reason == "stop":  # the grammar closed the object
        assert isinstance(json.loads(text), dict)
    else:  # an unbounded object may be cut at max_tokens: then it is an object's prefix
        assert reason == "length" and is_json_prefix(text), (reason, text)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize(("structured", "pattern"), [
    ({"regex": r"[0-9]{3}-[a-z]{2}"}, r"[0-9]{3}-[a-z]{2}"),
    ({"choice": ["red", "green", "a.b"]}, r"red|green|a\.b"),
    ({"grammar": 'start: "(" num ")"\nnum: /[1-9][0-9]?/'}, r"\([1-9][0-9]?\)"),
    ({"json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     r"\[((true|false)(,(true|false)){0,2})?\]"),
], ids=["regex", "choice", "grammar", "json"])
def test_vllm_structured_outputs_shape_the_text(
    cluster: Cluster, chat: bool, structured: dict[str, Any], pattern: str
) -> None:
    text, reason = _generate(cluster, chat, False, model="all-r16-rslora", max_tokens=40,
                             temperature=1.0, seed=9, extra_body={"structured_outputs": structured})
    assert re.fullmatch(pattern, text), text
    assert reason == "stop"


def test_constrained_and_free_requests_run_side_by_side(cluster: Cluster) -> None:
    """A free request running beside constrained ones (other adapters) keeps its greedy text."""
    client = cluster.gateway.openai()
    free_text, _ = worker_greedy(cluster.workers[0].target, "attn-r4",
                                 PromptInput(text=PROMPT), 12)

    def free() -> str:
        reply = client.completions.create(model="attn-r4", prompt=PROMPT, max_tokens=12,
                                          temperature=0)
        return reply.choices[0].text

    def constrained() -> str:
        reply = client.completions.create(model="mlp-r8", prompt=PROMPT, max_tokens=120,
                                          extra_body={"response_format": JSON_SCHEMA})
        return reply.choices[0].text

    with ThreadPoolExecutor(6) as pool:
        frees = [pool.submit(free) for _ in range(3)]
        shaped = [pool.submit(constrained) for _ in range(3)]
        assert [f.result() for f in frees] == [free_text] * 3
        for s in shaped:
            jsonschema.validate(json.loads(s.result()), PERSON)


def test_n_choices_are_each_constrained(cluster: Cluster) -> None:
    reply = cluster.gateway.openai().chat.completions.create(
        model="attn-r4", messages=CHAT, max_tokens=10, n=3, temperature=1.0, seed=1,  # type: ignore[arg-type]  # plain dicts, not openai's TypedDicts
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    )
    assert len(reply.choices) == 3
    assert all(c.message.content in ("yes", "no", "maybe") for c in reply.choices)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
], ids=["bad-schema", "no-name", "unknown-type", "bad-regex", "bad-grammar", "two-keys",
        "both-fields", "ignore-eos"])
def test_a_bad_constraint_is_a_400_naming_its_param(
    cluster: Cluster, chat: bool, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _generate(cluster, chat, False, model="attn-r4", max_tokens=4, extra_body=body)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]
