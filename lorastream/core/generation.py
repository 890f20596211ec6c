"""Plain types of the worker's API, shared by the worker, its clients (CLI, gateway) and the codec."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from lorastream.core.errors import InvalidArgument

GREEDY_TEMPERATURE = 1e-5
"""Temperatures at or below this are greedy: dividing logits by them would overflow float32."""

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
_MAX_SEED = 2**64 - 1


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
                f"stop_token_ids must be a list of token ids, got {type(self.stop_token_ids).__name__}"
            )
        for token_id in self.stop_token_ids:
            if not 0 <= _integer("stop_token_ids", token_id) < vocab_size:
                raise InvalidArgument(
                    f"stop_token_ids must be in [0, {vocab_size - 1}] (the vocabulary), "
                    f"got {token_id}"
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
    """Exactly one of the three forms."""

    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content), chat template
    token_ids: tuple[int, ...] | None = None


class FinishReason(Enum):
    STOP = "stop"  # end-of-sequence token, stop token or stop string
    LENGTH = "length"  # max_tokens or the context length
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class GenerationEvent:
    """Tokens generated since the previous event; the last event has ``finish_reason``."""

    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason | None = None


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
