"""Tool calling through the official ``openai`` client: tools rendered by the chat template,
forced calls constrained by the grammar, tool-call blocks parsed into ``tool_calls``.

The tiny model is random-weight: a forced call that parses and validates against the function's
schema proves the constraint reached the sampler; the prompt's token count proves the tools and
the earlier calls reached the template.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from lorastream.core.generation import FinishReason, GenerationEvent, PromptInput
from lorastream.gateway.openai_responses import Completed, ResponseBuilder
from lorastream.gateway.tools import ToolCallStream, ToolUse, parse_tool_calls
from tests.gateway.conftest import Cluster, ClusterFactory, worker_greedy
from tests.support.models import save_tiny_tokenizer

# A Hermes-style template (as Qwen2.5's, shortened): tools listed in a system turn, earlier calls
# written back as <tool_call> blocks, tool results as their own turn.
TOOL_TEMPLATE = (
    "{%- if tools %}<system>Tools:{% for t in tools %} {{ t.function.name }}"
    "{{ t.function.parameters | tojson }}{% endfor %}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<assistant>{% for c in m.tool_calls %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "\n</tool_call>{% endfor %}"
    "{%- elif m.role == 'tool' %}<tool {{ m.tool_call_id }}>{{ m.content }}"
    "{%- else %}<{{ m.role }}>{{ m.content }}{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6},
                   "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
STOCK = {
    "type": "object",
    "properties": {"ticker": {"type": "string", "maxLength": 4}, "days": {"type": "integer",
                                                                          "minimum": 1,
                                                                          "maximum": 30}},
    "required": ["ticker", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_stock", "parameters": STOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_stock": STOCK}
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tool_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's weights with a tokenizer that has "\\n" and a tool-aware template."""
    path = tmp_path_factory.mktemp("tool-model") / "model"
    shutil.copytree(tiny_model, path)
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    return save_tiny_tokenizer(path, vocab, newline=True, chat_template=TOOL_TEMPLATE)


@pytest.fixture(scope="module")
def tool_cluster(cluster_factory: ClusterFactory, tool_model: Path) -> Cluster:
    return cluster_factory(workers=1, checkpoint=tool_model)


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- forced calls through the client -----------------------------------------------------------
@pytest.mark.parametrize("model", ["tiny", "attn-r4"])
@pytest.mark.parametrize("seed", [1, 2])
def test_a_named_tool_choice_returns_a_valid_call_of_that_function(
    tool_cluster: Cluster, model: str, seed: int
) -> None:
    response = tool_cluster.gateway.openai().chat.completions.create(
        model=model, messages=CHAT, tools=TOOLS, tool_choice=NAMED, max_tokens=120,
        temperature=1.0, seed=seed,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls, {"get_weather"})


def test_a_streamed_forced_call_arrives_whole_in_the_last_chunk(tool_cluster: Cluster) -> None:
    chunks = list(tool_cluster.gateway.openai().chat.completions.create(
        model="mlp-r8", messages=CHAT, tools=TOOLS, tool_choice=NAMED, max_tokens=120,
        temperature=1.0, seed=3, stream=True,
    ))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert all(not d.delta.content for d in deltas)  # the call is never sent as content
    calls = [call for d in deltas for call in (d.delta.tool_calls or [])]
    assert [call.index for call in calls] == [0]
    _check_calls(calls, {"get_weather"})
    assert deltas[-1].finish_reason == "tool_calls"


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_required_calls_one_of_the_tools(tool_cluster: Cluster, seed: int) -> None:
    response = tool_cluster.gateway.openai().chat.completions.create(
        model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls, set(SCHEMAS))


def test_a_forced_call_and_a_free_request_share_a_batch(tool_cluster: Cluster) -> None:
    """The free request's greedy text is what it gets alone: the mask touched only its row."""
    client = tool_cluster.gateway.openai()
    free_prompt = "Weather in Paris?"
    alone, _ = worker_greedy(tool_cluster.workers[0].target, "attn-r4",
                             PromptInput(text=free_prompt), 40)

    def forced() -> Any:
        return client.chat.completions.create(
            model="tiny", messages=CHAT, tools=TOOLS, tool_choice=NAMED, max_tokens=120,
            temperature=1.0, seed=7)

    def free() -> str:
        return client.completions.create(model="attn-r4", prompt=free_prompt, max_tokens=40,
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(4) as pool:
        calls = [pool.submit(forced) for _ in range(2)]
        frees = [pool.submit(free) for _ in range(2)]
        for f in calls:
            _check_calls(f.result().choices[0].message.tool_calls, {"get_weather"})
        assert [f.result() for f in frees] == [alone, alone]


# -- what reaches the chat template ------------------------------------------------------------
def _prompt_tokens(cluster: Cluster, **kwargs: Any) -> int:
    response = cluster.gateway.openai().chat.completions.create(
        model="tiny", max_tokens=1, temperature=0, **kwargs)
    return response.usage.prompt_tokens


def test_tools_and_earlier_calls_reach_the_template(
    tool_cluster: Cluster, tool_model: Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model)
    history = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    rendered = [*CHAT, {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]}, history[2]]
    expected = tok.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True,
                                       tokenize=True, return_dict=False)
    assert _prompt_tokens(tool_cluster, messages=history, tools=TOOLS) == len(expected)
    without = _prompt_tokens(tool_cluster, messages=CHAT)
    assert _prompt_tokens(tool_cluster, messages=CHAT, tools=TOOLS) > without + 100
    # tool_choice none still renders the tools (as vLLM does); the output is text
    assert _prompt_tokens(tool_cluster, messages=CHAT, tools=TOOLS, tool_choice="none") > without


# -- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "param", "message"), [
    ({"tools": TOOLS}, "tools", "has no tool support"),  # the default template ignores tools
    ({"tools": [{"type": "retrieval"}]}, "tools", "only tools of type 'function'"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "name is required"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "given twice"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be 'none'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the tools"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
     "tool_choice", "constraint of its own"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
      "arguments": "{oops"}}]}]}, "messages", "not JSON"),
])
def test_bad_tool_requests_are_400_naming_the_field(
    cluster: Cluster, kwargs: dict[str, Any], param: str, message: str
) -> None:
    body: dict[str, Any] = {"messages": CHAT, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        cluster.gateway.openai().chat.completions.create(model="tiny", max_tokens=4, **body)
    error = err.value.body
    assert error["param"] == param and message in error["message"], error


# -- the parser and the response builder ---------------------------------------------------------
CALL_TEXT = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", '
             '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_stock", "arguments": '
             '{"ticker": "ACME", "days": 2}}\n</tool_call>')


@pytest.mark.parametrize(("text", "content", "names"), [
    (CALL_TEXT, "Let me check.", ["get_weather", "get_stock"]),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>', None, ["f"]),
    (' \n<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>\n', None, ["f"]),
    ("no call here", "no call here", []),
    ('text <tool_call>{"name": "f", "arguments"', None, []),  # unclosed: all of it is content
    ('<tool_call>{"name": 3}</tool_call>', None, []),  # not a call: content
    ('<tool_call>{"name": "f"}</tool_call> and more', None, []),  # text after a call: content
])
def test_tool_call_blocks_parse_into_calls_or_stay_content(
    text: str, content: str | None, names: list[str]
) -> None:
    parsed_content, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == names
    assert parsed_content == (content if names else text)
    for call in calls:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


@pytest.mark.parametrize("text", [CALL_TEXT, "plain <tool text", "a <tool_call>{bad</tool_call>"])
def test_a_streamed_choice_sends_the_same_content_and_calls_at_any_split(text: str) -> None:
    whole_content, whole_calls = parse_tool_calls(text)
    for cut in range(len(text) + 1):
        stream = ToolCallStream()
        sent = stream.feed(text[:cut]) + stream.feed(text[cut:])
        rest, calls = stream.finish()
        assert sent + rest == (whole_content or "" if whole_calls else text)
        assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]


@pytest.mark.parametrize("tools", [True, False], ids=["auto", "none"])
def test_the_builder_parses_calls_only_when_tools_are_active(tools: bool) -> None:
    builder = ResponseBuilder("m", chat=True, tools=tools)
    done = Completed()
    event = GenerationEvent((5,), CALL_TEXT, 3, 40, FinishReason.STOP)
    done.add(event)
    choice = builder.response(done)["choices"][0]
    if tools:
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Let me check."
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == [
            "get_weather", "get_stock"]
    else:
        assert choice == {"index": 0, "message": {"role": "assistant", "content": CALL_TEXT},
                          "logprobs": None, "finish_reason": "stop"}


def test_a_length_cut_call_stays_content_with_finish_length() -> None:
    builder = ResponseBuilder("m", chat=True, tools=True)
    text = '<tool_call>\n{"name": "get_weather", "argu'
    chunks = [builder.delta_chunk(GenerationEvent((1,), text[:9], 3, 1)),
              builder.delta_chunk(GenerationEvent((2,), text[9:], 3, 2, FinishReason.LENGTH))]
    assert chunks[0] is None  # a possible call is held
    last = chunks[1]["choices"][0]
    assert last["delta"] == {"content": text} and last["finish_reason"] == "length"


def test_required_grammar_lists_every_tool_and_named_only_one() -> None:
    required = ToolUse(tuple(TOOLS), "required").constraint()
    named = ToolUse(tuple(TOOLS), NAMED).constraint()
    assert required is not None and named is not None
    assert '"get_stock"' in required.spec and '"get_weather"' in required.spec
    assert '"get_stock"' not in named.spec and "call)*" not in named.spec
    assert ToolUse(tuple(TOOLS), "auto").constraint() is None
    assert ToolUse(tuple(TOOLS), "none").constraint() is None
