"""OpenAI response bodies and stream chunks, built from the worker's events (plain dicts).

Shapes follow the OpenAI API reference: ``text_completion`` for completions (the same object in
the stream), ``chat.completion`` and ``chat.completion.chunk`` for chat. Each choice's stream ends
with a chunk carrying its ``finish_reason`` (chunks of the n choices interleave, told apart by
``index``), then (with ``stream_options.include_usage``) a chunk with empty
``choices`` and the usage, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lorastream.core.generation import FinishReason, GenerationEvent, TokenLogprobs, TopLogprob
from lorastream.gateway.tools import ToolCallStream, parse_tool_calls

SSE_DONE = b"data: [DONE]\n\n"
LOGPROB_FLOOR = -9999.0
"""Logprobs below this (-inf: masked by min_tokens) are sent as this."""

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "stop"}
_TOOL_CALLS = "tool_calls"  # finish reason of a chat choice that ended in tool calls


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens``: prompt tokens the worker's prefix cache supplied."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finish_reason(event: GenerationEvent) -> str | None:
    return _FINISH[event.finish_reason] if event.finish_reason is not None else None


@dataclass
class CompletedChoice:
    """One choice of a generation, collected."""

    index: int = 0
    text: str = ""
    completion_tokens: int = 0
    finish_reason: str = "stop"
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    def add(self, event: GenerationEvent) -> None:
        self.text += event.text
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        self.completion_tokens = event.completion_tokens
        self.finish_reason = finish_reason(event) or self.finish_reason


@dataclass
class Completed:
    """A whole generation, collected: its choices by index (n of them)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, from the worker's prefix cache
    choices: dict[int, CompletedChoice] = field(default_factory=dict)

    def add(self, event: GenerationEvent) -> None:
        self.prompt_tokens = event.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
        self.choices.setdefault(event.index, CompletedChoice(event.index)).add(event)

    @property
    def completion_tokens(self) -> int:
        """Tokens of every choice (OpenAI's usage for n > 1)."""
        return sum(c.completion_tokens for c in self.choices.values())


class ResponseBuilder:
    """Bodies of one request: ``chat`` picks chat.completion shapes over text_completion."""

    def __init__(
        self, model: str, chat: bool, request_id: str | None = None, logprobs: bool = False,
        tools: bool = False,
    ) -> None:
        self.model = model
        self.chat = chat
        self.id = request_id or new_request_id(chat)
        self.created = int(time.time())
        self.logprobs = logprobs
        """The request asked for logprobs: every choice carries them."""
        self.tools = tools
        """Chat with tools (tool_choice not "none"): tool-call blocks become ``tool_calls``."""
        self._text_offsets: dict[int, int] = {}  # completions: where a choice's next token starts
        self._tool_streams: dict[int, ToolCallStream] = {}  # per choice, when streaming tools
        self._cached_tokens = 0  # streaming: the prompt's cached tokens, for the usage chunk

    # -- whole responses ----------------------------------------------------------------------
    def response(self, done: Completed) -> dict[str, Any]:
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": [self._choice(done.choices[i]) for i in sorted(done.choices)],
            "usage": usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens),
        }

    def _choice(self, done: CompletedChoice) -> dict[str, Any]:
        logprobs = self._logprobs(done.logprobs, done.index)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": done.text}
            reason = done.finish_reason
            calls = parse_tool_calls(done.text) if self.tools else (None, [])
            if calls[1]:
                message = {"role": "assistant", "content": calls[0], "tool_calls": calls[1]}
                reason = _TOOL_CALLS if reason == "stop" else reason
            return {
                "index": done.index, "message": message, "logprobs": logprobs,
                "finish_reason": reason,
            }
        return {
            "index": done.index, "text": done.text, "logprobs": logprobs,
            "finish_reason": done.finish_reason,
        }

    # -- stream chunks ------------------------------------------------------------------------
    def role_chunk(self, index: int = 0) -> dict[str, Any]:
        """Chat streams open with the assistant role (OpenAI sends it with empty content), once
        per choice."""
        return self._chunk({"role": "assistant", "content": ""}, None, index=index)

    def delta_chunk(self, event: GenerationEvent) -> dict[str, Any] | None:
        """The chunk of one event; None when it carries neither text nor a finish reason.

        With tools, a choice's text from its first tool-call block on is held, and its last
        chunk carries the parsed ``tool_calls`` (each whole, with its index) and finish reason
        ``tool_calls``; text that turns out not to be a call is sent as content then."""
        self._cached_tokens = max(self._cached_tokens, event.cached_tokens)
        reason = finish_reason(event)
        text = event.text
        calls: list[dict[str, Any]] = []
        if self.tools:
            stream = self._tool_streams.setdefault(event.index, ToolCallStream())
            text = stream.feed(event.text)
            if reason is not None:
                rest, calls = stream.finish()
                text += rest
                reason = _TOOL_CALLS if calls and reason == "stop" else reason
        if not text and reason is None and not (self.logprobs and event.logprobs):
            return None
        logprobs = self._logprobs(event.logprobs, event.index)
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(calls)]
            return self._chunk(delta, reason, logprobs, event.index)
        return self._chunk(text, reason, logprobs, event.index)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {
            **self._head(self._chunk_object),
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, self._cached_tokens),
        }

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(
        self, delta: dict[str, Any] | str, reason: str | None,
        logprobs: dict[str, Any] | None = None, index: int = 0,
    ) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
            }
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": reason}
        return {**self._head(self._chunk_object), "choices": [choice], "usage": None}

    # -- logprobs -----------------------------------------------------------------------------
    def _logprobs(self, entries: Sequence[TokenLogprobs], index: int) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` object of these tokens (None when the request did not ask).

        Chat: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``.
        Completions: ``{tokens, token_logprobs, top_logprobs, text_offset}``, where
        ``top_logprobs`` maps token text to logprob and holds the sampled token too (as vLLM
        and OpenAI do); ``text_offset`` counts characters of the token texts from the start of
        the completion.
        """
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [_chat_entry(e) for e in entries], "refusal": None}
        offsets = []
        offset = self._text_offsets.get(index, 0)
        for e in entries:
            offsets.append(offset)
            offset += len(e.token)
        self._text_offsets[index] = offset
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [
                {**{t.token: _finite(t.logprob) for t in e.top}, e.token: _finite(e.logprob)}
                for e in entries
            ],
            "text_offset": offsets,
        }

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def _chat_entry(entry: TokenLogprobs) -> dict[str, Any]:
    return {
        **_chat_token(entry),
        "top_logprobs": [_chat_token(t) for t in entry.top],
    }


def _chat_token(token: TokenLogprobs | TopLogprob) -> dict[str, Any]:
    return {
        "token": token.token, "logprob": _finite(token.logprob),
        "bytes": list(token.token.encode("utf-8")),
    }


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token that could not be sampled gets -9999.0 (as vLLM sends)."""
    return max(logprob, LOGPROB_FLOOR)


def new_request_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
