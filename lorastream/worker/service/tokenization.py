"""The worker's Tokenize and Detokenize calls in plain Python, with the tokenizer generation uses.

A plain prompt with special tokens, and chat messages with the generation prompt and without
extra special tokens, give exactly the ids a completion or chat completion would prefill (the
same calls as :class:`~lorastream.worker.engine.intake.RequestIntake`), so ``count`` is what
``usage.prompt_tokens`` will say.
"""

from __future__ import annotations

from typing import Any

from lorastream.core.errors import InvalidArgument
from lorastream.core.tokenization import Tokenized, TokenizeInput
from lorastream.worker.engine.chat_template import render_chat
from lorastream.worker.engine.detokenizer import Tokenizer
from lorastream.worker.engine.intake import RequestIntake


def tokenize(intake: RequestIntake, request: TokenizeInput, tokenizer: Tokenizer) -> Tokenized:
    """Token ids of ``request.prompt`` (text or chat messages; may be empty) with ``tokenizer``
    (``request.model``'s: ``Engine.tokenizer_for``)."""
    tok: Any = tokenizer
    prompt = request.prompt
    if prompt.token_ids is not None:
        raise InvalidArgument("prompt: give text or chat messages to tokenize, not token ids")
    if prompt.messages is not None:
        text = render_chat(tok, intake.model_name, prompt,
                           add_generation_prompt=request.add_generation_prompt, tokenize=False)
    else:
        text = prompt.text or ""
    ids = [int(i) for i in tok(text, add_special_tokens=request.add_special_tokens).input_ids]
    strs = tuple(tok.convert_ids_to_tokens(ids)) if request.return_token_strs else None
    return Tokenized(tuple(ids), intake.max_seq_len, strs)


def detokenize(intake: RequestIntake, tokens: list[int], tokenizer: Tokenizer) -> str:
    """The text of ``tokens`` with ``tokenizer``, special tokens included (as vLLM's
    /detokenize)."""
    bad = [t for t in tokens if not 0 <= t < intake.vocab_size]
    if bad:
        raise InvalidArgument(
            f"tokens {bad[:5]} are outside the vocabulary 0..{intake.vocab_size - 1}"
        )
    text: str = tokenizer.decode(tokens)
    return text
