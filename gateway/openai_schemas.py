"""OpenAI request bodies (pydantic), and their translation to the worker's plain types.

Fields OpenAI defines that this server cannot honour are refused with a 400 naming the field (a
silently ignored ``n=3`` or ``logprobs`` would hand the client something it did not ask for);
each refusal is a field validator, so the error's ``param`` names the field. LoRAX's
``adapter_id`` is honoured like ``model`` (never ignored: a request naming an adapter must not be
answered by the base model). Other unknown fields are ignored, as vLLM does, so vendor extensions
do not break clients.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationInfo, field_validator

from lorastream.core.errors import InvalidArgument
from lorastream.core.generation import PromptInput, SamplingParams

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1

StrictInt = Annotated[int, Strict()]
TokenId = Annotated[int, Strict(), Field(ge=0, le=_INT32_MAX)]
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's documented default for /v1/completions; chat defaults to the worker's own."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _GenerationRequest(BaseModel):
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
    n: StrictInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    adapter_id: str | None = Field(
        None, min_length=1, description="LoRAX's name for the adapter: honoured like `model`."
    )
    adapter_source: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported (one choice per request); send n requests")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("penalties are not supported; leave it unset or 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported; leave it unset")
        return value

    @field_validator("adapter_source")
    @classmethod
    def _no_adapter_source(cls, value: str | None) -> str | None:
        if value:
            raise ValueError(
                "adapter_source is not supported: register the adapter with the store "
                "(`lorastream adapters preload` or POST /v1/adapters), then name it by "
                "adapter_id or model"
            )
        return value

    def target(self, base_model: str | None) -> str:
        """The adapter (or base model) this request names: ``adapter_id`` wins over a ``model``
        that names the base model or the same adapter; a conflicting pair is refused."""
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
        )

    def _max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False
    suffix: str | None = None
    logprobs: StrictInt | None = None
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

    @field_validator("echo", "suffix", "logprobs", "best_of")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value and not (info.field_name == "best_of" and value == 1):
            raise ValueError(f"{info.field_name} is not supported by this server; leave it unset")
        return value

    def prompt_input(self) -> PromptInput:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return PromptInput(text=prompt)
        return PromptInput(token_ids=tuple(prompt))  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

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


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``; the worker renders ``messages`` with its chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=_INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _text_only(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        for message in value:
            message.text()  # raises on non-text parts
        return value

    @field_validator("logprobs", "top_logprobs", "tools")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and value not in (False, []):
            raise ValueError(f"{info.field_name} is not supported by this server; leave it unset")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if value not in (None, "none"):
            raise ValueError("tools are not supported by this server, so tool_choice can only be "
                             "'none'; leave it unset")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and value.get("type") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return value

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompt_input(self) -> PromptInput:
        # OpenAI's "developer" role is the newer name of "system"; chat templates know the latter.
        messages = tuple(
            ("system" if m.role == "developer" else m.role, m.text()) for m in self.messages
        )
        return PromptInput(messages=messages)
