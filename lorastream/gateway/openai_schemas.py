"""OpenAI request bodies (pydantic), and their translation to the worker's plain types.

Fields OpenAI defines that this server cannot honour are refused with a 400 naming the field (a
silently ignored ``best_of`` or ``echo`` would hand the client something it did not ask for);
each refusal is a field validator, so the error's ``param`` names the field. LoRAX's
``adapter_id`` is honoured like ``model`` (never ignored: a request naming an adapter must not be
answered by the base model). vLLM's extras that this server does not implement are refused the
same way (lorastream/gateway/vllm_extras.py). A weighted mix of adapters comes as the ``lora``
field (llama.cpp's: ``[{"name": ..., "scale": ...}]``, ``"id"`` accepted for ``"name"``) or as
the ``model`` spelling ``mix:a=0.7,b=0.3`` (``lorastream/core/adapter_mix.py``); either way the
request's model is that spelling from here on. Other unknown fields are ignored, as vLLM does, so
vendor extensions do not break clients.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationInfo,
    field_validator,
)

from lorastream.core.adapter_mix import check_mix, mix_model, parse_mix_model
from lorastream.core.errors import InvalidArgument
from lorastream.core.generation import MAX_CHOICES, MAX_LOGPROBS, PromptInput, SamplingParams
from lorastream.gateway.structured import structured_output
from lorastream.gateway.tools import ToolUse, check_tool_choice, check_tools
from lorastream.gateway.vllm_extras import VllmChatExtras, VllmExtras

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1

StrictInt = Annotated[int, Strict()]
TokenId = Annotated[int, Strict(), Field(ge=0, le=_INT32_MAX)]
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's documented default for /v1/completions; chat defaults to the worker's own."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class LoraComponent(BaseModel):
    """One adapter of a weighted mix (the ``lora`` field)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        min_length=1, validation_alias=AliasChoices("name", "id"),
        description="Adapter name (llama.cpp's key \"id\" is accepted too).",
    )
    scale: float = Field(1.0, allow_inf_nan=False, description="Its weight; finite, any sign.")


class _GenerationRequest(VllmExtras):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, description="An adapter name, or the base model's id.")
    max_tokens: StrictInt | None = Field(None, ge=1, le=_INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2, description="Default 1; 0 is greedy.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1, le=_INT32_MAX, description="0 or -1 disable.")
    seed: StrictInt | None = Field(None, ge=0, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    n: StrictInt = Field(
        1, ge=1, le=MAX_CHOICES, description="Choices; the prompt is prefilled once."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(
        None, gt=0, description="vLLM's extra: HF's penalty over prompt + generated tokens."
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100]."
    )
    min_tokens: StrictInt = Field(0, ge=0, le=_INT32_MAX)
    adapter_id: str | None = Field(
        None, min_length=1, description="LoRAX's name for the adapter: honoured like `model`."
    )
    adapter_source: Literal["hub", "s3", "local", "pbase"] | None = Field(
        None, description="LoRAX's source of adapter_id: checked against the staged adapter's "
        "(lorastream/gateway/lorax.py)."
    )
    lora: list[LoraComponent] | None = Field(
        None, min_length=1, description="A weighted mix of adapters (PEFT's "
        "add_weighted_adapter, combination_type 'cat'); `model` names the base model then.",
    )
    response_format: dict[str, Any] | None = Field(
        None, description="OpenAI's: text, json_object or json_schema (lorastream/gateway/"
        "structured.py)."
    )
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's extra: exactly one of json, regex, choice, grammar."
    )

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) > _INT32_MAX:
                raise ValueError(f"keys must be token ids (as strings, e.g. '50256'), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return value

    @property
    def model_param(self) -> str:
        """The request field that names what it runs on (where its errors point)."""
        return "lora" if self.lora else "adapter_id" if self.adapter_id else "model"

    def target(self, base_model: str | None) -> str:
        """The adapter (or base model, or mix) this request names: ``adapter_id`` wins over a
        ``model`` that names the base model or the same adapter; a conflicting pair is refused.
        A mix (``lora``, or ``model`` spelled ``mix:...``) is its canonical ``mix:`` spelling;
        ``lora`` goes with a ``model`` of the base model's id (or the same mix)."""
        if self.lora:
            mix = mix_model(check_mix([(c.name, c.scale) for c in self.lora]))
            if self.adapter_id is None and self.model in (base_model, mix):
                return mix
            raise InvalidArgument(
                f"lora names a mix of adapters, but model {self.model!r} (or adapter_id) names "
                "another model; set model to the base model's id and leave out adapter_id"
            )
        parsed = parse_mix_model(self.model)
        if parsed is not None and self.adapter_id is None:
            return mix_model(parsed)
        if self.adapter_id is None or self.adapter_id == self.model:
            return self.model
        if base_model is not None and self.model == base_model:
            return self.adapter_id
        raise InvalidArgument(
            f"adapter_id {self.adapter_id!r} and model {self.model!r} name different models; "
            "send one of them, or set model to the base model's id"
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        """The worker's sampling parameters; ``default_max_tokens`` 0 = the worker's default."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            max_tokens=self._max_tokens() or default_max_tokens,
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=tuple(sorted((int(k), b) for k, b in (self.logit_bias or {}).items())),
            min_tokens=self.min_tokens,
            logprobs=self.top_logprobs_count(),
            n=self.n,
            structured=structured_output(self.response_format, self.structured_outputs),
        )

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def top_logprobs_count(self) -> int | None:
        """None: no logprobs; k: the sampled token's and the k most likely tokens'."""
        raise NotImplementedError


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False
    suffix: str | None = None
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: StrictInt | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        batch = isinstance(value, list) and value and isinstance(value[0], (str, list))
        if batch and len(value) != 1:
            raise ValueError(
                f"one prompt per request is supported, got {len(value)}; send one request each"
            )
        if value in ("", []) or value in ([""], [[]]):
            raise ValueError("the prompt is empty")
        return value

    @field_validator("echo", "suffix", "best_of")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value and not (info.field_name == "best_of" and value == 1):
            raise ValueError(f"{info.field_name} is not supported by this server; leave it unset")
        return value

    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_input(self) -> PromptInput:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return PromptInput(text=prompt)
        return PromptInput(token_ids=tuple(prompt))  # type: ignore[arg-type]  # list[int] by now: str and nested lists were taken above


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for call in value or ():
            _template_call(call)  # raises on a call a template could not render
        return value

    def extra(self) -> str:
        """The keys besides role and content the chat template reads, as JSON ("" for none).

        An earlier call's ``arguments`` (a JSON string in OpenAI's API) reach the template as
        an object, which is what chat templates write back (vLLM does the same)."""
        extra: dict[str, Any] = {}
        if self.tool_calls:
            extra["tool_calls"] = [_template_call(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            extra["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            extra["name"] = self.name
        return json.dumps(extra) if extra else ""

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"only text content parts are supported, got {part.type!r}")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_GenerationRequest, VllmChatExtras):
    """``POST /v1/chat/completions``; the worker renders ``messages`` with its chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=_INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @field_validator("messages")
    @classmethod
    def _text_only(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        for message in value:
            message.text()  # raises on non-text parts
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true; set both, or leave it unset")
        return value

    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return check_tools(value) if value else None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(
        cls, value: str | dict[str, Any] | None, info: ValidationInfo
    ) -> str | dict[str, Any] | None:
        check_tool_choice(value)
        if value not in (None, "none") and not info.data.get("tools"):
            raise ValueError("needs tools: give the tools the model may call, or leave it unset")
        return value

    @property
    def tool_use(self) -> ToolUse:
        """The request's tools (docs/gateway-api.md, "Tools"); ``tool_choice`` defaults to auto."""
        return ToolUse(tuple(self.tools or ()), self.tool_choice or "auto",
                       self.parallel_tool_calls)

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        params = super().sampling(default_max_tokens)
        forced = self.tool_use.constraint()
        if forced is None:
            return params
        if params.structured is not None:
            raise InvalidArgument(
                "tool_choice: a forced tool call is a constraint of its own; drop "
                "response_format or structured_outputs, or set tool_choice to 'auto'"
            )
        return dataclasses.replace(params, structured=forced)

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompt_input(self) -> PromptInput:
        return chat_prompt(self.messages, self.tool_use.rendered)


def chat_prompt(messages: list[ChatMessage], tools: str = "") -> PromptInput:
    """The worker's chat prompt of OpenAI ``messages`` (chat completions and /tokenize alike)."""
    # OpenAI's "developer" role is the newer name of "system"; chat templates know the latter.
    turns = tuple(("system" if m.role == "developer" else m.role, m.text()) for m in messages)
    extras = tuple(m.extra() for m in messages)
    return PromptInput(messages=turns, message_extras=extras if any(extras) else (), tools=tools)


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's earlier tool call as chat templates read it."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError("each tool call needs function.name and function.arguments")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"tool call arguments are not JSON: {exc}") from None
    return {**call, "function": {**function, "arguments": arguments}}
