"""OpenAI response bodies and stream chunks, built from the worker's events (plain dicts).

Shapes follow the OpenAI API reference: ``text_completion`` for completions (the same object in
the stream), ``chat.completion`` and ``chat.completion.chunk`` for chat. A stream ends with a chunk
carrying ``finish_reason``, then (with ``stream_options.include_usage``) a chunk with empty
``choices`` and the usage, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from lorastream.core.generation import FinishReason, GenerationEvent

SSE_DONE = b"data: [DONE]\n\n"

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "stop"}


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(event: GenerationEvent) -> str | None:
    return _FINISH[event.finish_reason] if event.finish_reason is not None else None


@dataclass
class Completed:
    """A whole generation, collected."""

    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"
    token_ids: list[int] = field(default_factory=list)

    def add(self, event: GenerationEvent) -> None:
        self.text += event.text
        self.token_ids.extend(event.token_ids)
        self.prompt_tokens = event.prompt_tokens
        self.completion_tokens = event.completion_tokens
        self.finish_reason = finish_reason(event) or self.finish_reason


class ResponseBuilder:
    """Bodies of one request: ``chat`` picks chat.completion shapes over text_completion."""

    def __init__(self, model: str, chat: bool, request_id: str | None = None) -> None:
        self.model = model
        self.chat = chat
        self.id = request_id or new_request_id(chat)
        self.created = int(time.time())

    # -- whole responses ----------------------------------------------------------------------
    def response(self, done: Completed) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": done.text},
                "logprobs": None,
                "finish_reason": done.finish_reason,
            }
        else:
            choice = {
                "index": 0, "text": done.text, "logprobs": None,
                "finish_reason": done.finish_reason,
            }
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": [choice],
            "usage": usage(done.prompt_tokens, done.completion_tokens),
        }

    # -- stream chunks ------------------------------------------------------------------------
    def role_chunk(self) -> dict[str, Any]:
        """Chat streams open with the assistant role (OpenAI sends it with empty content)."""
        return self._chunk({"role": "assistant", "content": ""}, None)

    def delta_chunk(self, event: GenerationEvent) -> dict[str, Any] | None:
        """The chunk of one event; None when it carries neither text nor a finish reason."""
        reason = finish_reason(event)
        if not event.text and reason is None:
            return None
        if self.chat:
            return self._chunk({"content": event.text} if event.text else {}, reason)
        return self._chunk(event.text, reason)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {
            **self._head(self._chunk_object),
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens),
        }

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, delta: dict[str, Any] | str, reason: str | None) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0, "delta": delta, "logprobs": None, "finish_reason": reason,
            }
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}
        return {**self._head(self._chunk_object), "choices": [choice], "usage": None}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def new_request_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
