"""Plain types of the worker's Tokenize and Detokenize calls (vLLM's ``/tokenize`` and
``/detokenize``), shared by the codec, the worker and the gateway."""

from __future__ import annotations

from dataclasses import dataclass

from lorastream.core.generation import PromptInput


@dataclass(frozen=True)
class TokenizeInput:
    """What to tokenize: ``prompt`` as text or chat messages (not token ids).

    ``add_generation_prompt``: chat only, end with the assistant turn's header.
    ``add_special_tokens``: add the tokenizer's BOS and the like (a completion prompt gets them;
    a chat template writes its own).
    ``model``: the adapter whose tokenizer to use ("" or the base model's name: the base's).
    """

    prompt: PromptInput
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False
    model: str = ""


@dataclass(frozen=True)
class Tokenized:
    """Token ids, the worker's context length, and each token's string when asked for."""

    tokens: tuple[int, ...]
    max_model_len: int
    token_strs: tuple[str, ...] | None = None
