"""Plain types of the worker's API, shared by the worker, its clients (CLI, gateway) and the
codec."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from lorastream.core.errors import InvalidArgument
from lorastream.core.structured import StructuredOutput

GREEDY_TEMPERATURE = 1e-5
"""Temperatures at or below this are greedy: dividing logits by them would overflow float32."""

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
_MAX_SEED = 2**64 - 1
MAX_LOGPROBS = 20
"""Most top log-probabilities a request can ask for (per generated token)."""
MAX_LOGIT_BIAS = 1024
MAX_CHOICES = 16
"""Most choices (``n``) one request can ask for."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next token and when it stops."""

    temperature: float = 0.0
    """0 = greedy; otherwise logits are divided by it before the softmax."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables."""
    top_k: int = 0
    """Keep the k most likely tokens (ties with the k-th kept); 0 disables."""
    max_tokens: int = 256
    """Most tokens to generate (>= 1)."""
    seed: int | None = None
    """Seed of the request's own generator; None draws from the process-wide generator."""
    stop: tuple[str, ...] = ()
    """Stop strings; the output ends just before the first one (it is not included)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation besides EOS."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token generated so far, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted once per occurrence of a token generated so far, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """HF's, over prompt + generated tokens: such a logit is divided by it when positive,
    multiplied when negative; > 0, 1 disables."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias in [-100, 100]) pairs added to the logits; a token appears at most once."""
    min_tokens: int = 0
    """EOS and ``stop_token_ids`` cannot be generated before this many tokens (<= max_tokens)."""
    logprobs: int | None = None
    """None: no log-probabilities; k in [0, 20]: the sampled token's and the k most likely."""
    n: int = 1
    """Choices to generate for the prompt (prefilled once); choice i samples with seed + i."""
    structured: StructuredOutput | None = None
    """Structured outputs: every choice's output matches this constraint and ends (reason
    "stop") once it is complete; None: free text."""

    @property
    def processes_logits(self) -> bool:
        """True when a penalty, a logit bias or min_tokens changes this request's logits."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0, or too small to divide by)."""
        return self.temperature <= GREEDY_TEMPERATURE

    def validate(self, vocab_size: int) -> None:
        """Raise :class:`InvalidArgument` naming the first parameter that is out of range."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        temperature = _real("temperature", self.temperature)
        if temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0, got {temperature}")
        top_p = _real("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {top_p}")
        if _integer("top_k", self.top_k) < 0:
            raise InvalidArgument(f"top_k must be 0 (disabled) or >= 1, got {self.top_k}")
        if _integer("max_tokens", self.max_tokens) < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= _integer("seed", self.seed) <= _MAX_SEED:
            raise InvalidArgument(f"seed must be in [0, 2**64 - 1], got {self.seed}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgument(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        self._validate_stop()
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(
            self.stop_token_ids, Sequence
        ):
            raise InvalidArgument(
                "stop_token_ids must be a list of token ids, "
                f"got {type(self.stop_token_ids).__name__}"
            )
        for token_id in self.stop_token_ids:
            if not 0 <= _integer("stop_token_ids", token_id) < vocab_size:
                raise InvalidArgument(
                    f"stop_token_ids must be in [0, {vocab_size - 1}] (the vocabulary), "
                    f"got {token_id}"
                )
        self._validate_logits_processing(vocab_size)
        self._validate_structured()

    def _validate_structured(self) -> None:
        if self.structured is None:
            return
        if not isinstance(self.structured, StructuredOutput):
            raise InvalidArgument(
                f"structured must be a StructuredOutput, got {type(self.structured).__name__}"
            )
        self.structured.validate()
        if self.ignore_eos:
            raise InvalidArgument(
                f"ignore_eos cannot be combined with {self.structured.param}: a constrained "
                "output ends when it is complete; leave ignore_eos unset"
            )

    def _validate_logits_processing(self, vocab_size: int) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise InvalidArgument(f"{name} must be in [-2, 2], got {value}")
        if _real("repetition_penalty", self.repetition_penalty) <= 0:
            raise InvalidArgument(
                f"repetition_penalty must be > 0 (1 disables), got {self.repetition_penalty}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument(
                f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}"
            )
        seen: set[int] = set()
        for token_id, bias in self.logit_bias:
            if not 0 <= _integer("logit_bias", token_id) < vocab_size:
                raise InvalidArgument(
                    f"logit_bias keys must be token ids in [0, {vocab_size - 1}] (the "
                    f"vocabulary), got {token_id}"
                )
            if token_id in seen:
                raise InvalidArgument(f"logit_bias names token {token_id} twice")
            seen.add(token_id)
            if not -100 <= _real("logit_bias", bias) <= 100:
                raise InvalidArgument(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}"
                )
        if _integer("min_tokens", self.min_tokens) < 0:
            raise InvalidArgument(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise InvalidArgument(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if not 1 <= _integer("n", self.n) <= MAX_CHOICES:
            raise InvalidArgument(f"n (the number of choices) must be in [1, {MAX_CHOICES}], "
                                  f"got {self.n}")
        if self.logprobs is not None and not 0 <= _integer("logprobs", self.logprobs) <= (
            MAX_LOGPROBS
        ):
            raise InvalidArgument(
                f"logprobs (the number of top log-probabilities) must be in [0, {MAX_LOGPROBS}], "
                f"got {self.logprobs}"
            )

    def _validate_stop(self) -> None:
        if isinstance(self.stop, (str, bytes)) or not isinstance(self.stop, Sequence):
            raise InvalidArgument(
                f"stop must be a list of strings, got {type(self.stop).__name__}; "
                "wrap a single stop string in a list"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument(
                f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
            )
        for s in self.stop:
            if not isinstance(s, str):
                raise InvalidArgument(f"stop strings must be strings, got {s!r}")
            if not s:
                raise InvalidArgument("stop strings must not be empty; remove the empty string")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidArgument(
                    f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, "
                    f"got one of {len(s)}"
                )


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number, got {value}")
    return float(value)


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class PromptInput:
    """Exactly one of the three forms.

    With ``messages``: ``message_extras`` holds, per message (or empty for none at all), a JSON
    object of its other keys the chat template reads (an assistant's ``tool_calls``, a tool
    result's ``tool_call_id`` and ``name``), "" for none; ``tools`` is the JSON array of tools the
    template renders ("" for none).
    """

    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content), chat template
    token_ids: tuple[int, ...] | None = None
    message_extras: tuple[str, ...] = ()
    tools: str = ""

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as a chat template takes them: ``role``, ``content`` and the extras."""
        extras = self.message_extras or ("",) * len(self.messages or ())
        return [
            {"role": role, "content": content, **(json.loads(extra) if extra else {})}
            for (role, content), extra in zip(self.messages or (), extras, strict=True)
        ]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as a chat template takes them (None: no tools)."""
        return json.loads(self.tools) if self.tools else None


class FinishReason(Enum):
    STOP = "stop"  # end-of-sequence token, stop token or stop string
    LENGTH = "length"  # max_tokens or the context length
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class TopLogprob:
    """One candidate token and its log-probability."""

    token_id: int
    token: str  # the token decoded on its own (U+FFFD for an incomplete UTF-8 sequence)
    logprob: float  # -inf for a token the request's min_tokens or logit_bias ruled out


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one generated position: the sampled token's and the top ones.

    Values are ``log_softmax`` of the logits after penalties, logit bias and the min_tokens
    mask, before temperature, top-k and top-p (docs/gateway-api.md, "Sampling parameters").
    """

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()  # most likely first; as many as the request asked for


@dataclass(frozen=True)
class GenerationEvent:
    """Tokens generated since the previous event; the last event has ``finish_reason``."""

    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per token of ``token_ids`` when the request asked for logprobs, else empty."""
    index: int = 0
    """The choice these tokens belong to (0 .. n - 1); each choice ends with its own
    ``finish_reason``, and ``completion_tokens`` counts that choice's tokens."""
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the worker's prefix cache (not prefilled again)."""


@dataclass(frozen=True)
class AdapterStatus:
    """Where one adapter resides on a worker."""

    name: str
    adapter_id: str
    residency: str  # "remote" | "loading" | "host" | "device"
    rank: int
    nbytes: int
    pinned: bool
    references: int
    slot: int  # -1 when not in a slot


@dataclass(frozen=True)
class WorkerStats:
    base_model: str
    waiting_requests: int
    running_requests: int
    loading_adapters: int
    device_slots_total: int
    device_slots_used: int
    host_bytes_used: int
    host_bytes_budget: int
    kv_tokens_used: int
    kv_tokens_total: int
    generated_tokens_total: int
    requests_finished_total: int
