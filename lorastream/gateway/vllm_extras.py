"""vLLM's extra request fields that this server does not implement: refused, never ignored.

Unknown fields are otherwise ignored (vendor extensions must not break clients), but a client
written for vLLM that sends ``min_p`` or ``use_beam_search`` expects them to act; answering as if
they were absent would hand it something it did not ask for. Each field here is accepted only at
its neutral value (what vLLM does when it is absent); anything else is a 400 naming the field.
The fields vLLM has and this server implements are declared on the request models themselves
(``top_k``, ``min_tokens``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``,
``structured_outputs``; docs/gateway-api.md has the table).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationInfo, field_validator

_NEUTRAL: dict[str, Any] = {
    "min_p": 0.0,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "prompt_logprobs": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": None,
    "logits_processors": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "guided_decoding_backend": None,
}
_CHAT_NEUTRAL: dict[str, Any] = {
    "chat_template": None,
    "chat_template_kwargs": None,
    "continue_final_message": False,
    "add_generation_prompt": True,
    "documents": None,
}
_HINT = {
    "guided_json": "use structured_outputs: {\"json\": ...} or response_format",
    "guided_regex": "use structured_outputs: {\"regex\": ...}",
    "guided_choice": "use structured_outputs: {\"choice\": [...]}",
    "guided_grammar": "use structured_outputs: {\"grammar\": ...}",
    "chat_template": "the worker renders the model's own chat template",
}


def _refuse_unless_neutral(value: Any, info: ValidationInfo, neutral: dict[str, Any]) -> Any:
    name = info.field_name or ""
    if value is None or value == neutral[name]:
        return value
    hint = _HINT.get(name, f"leave it unset (or {neutral[name]!r})")
    raise ValueError(f"{name} is not supported by this server; {hint}")


class VllmExtras(BaseModel):
    """vLLM's sampling extras this server does not implement (completions and chat)."""

    min_p: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None

    @field_validator(*_NEUTRAL)
    @classmethod
    def _neutral(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless_neutral(value, info, _NEUTRAL)


class VllmChatExtras(BaseModel):
    """vLLM's chat-template extras this server does not implement."""

    chat_template: Any = None
    chat_template_kwargs: Any = None
    continue_final_message: Any = None
    add_generation_prompt: Any = None
    documents: Any = None

    @field_validator(*_CHAT_NEUTRAL)
    @classmethod
    def _neutral_chat(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_unless_neutral(value, info, _CHAT_NEUTRAL)
