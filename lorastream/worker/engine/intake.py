"""Request intake, on the request threads: turn a prompt and sampling parameters into a
:class:`Sequence` the scheduler can run, or raise a clear error (nothing is queued then).

Checked here, before a request ever reaches the step loop: sampling parameters, token ids
inside the vocabulary, a chat template for chat prompts, a non-empty prompt that fits the
context, and a KV cache large enough for prompt + ``max_tokens``. A structured-output constraint
is compiled here too (a bad schema, regex or grammar is refused, naming its parameter), by the
worker's one :class:`~lorastream.worker.engine.grammar.GrammarCompiler`, built at the first
constrained request (llguidance reads the whole vocabulary: 0.3 s for SmolLM2, 5 s for Gemma 3).
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from lorastream.core.errors import InvalidArgument
from lorastream.core.generation import PromptInput
from lorastream.worker.engine.activation import activation_start
from lorastream.worker.engine.chat_template import render_chat
from lorastream.worker.engine.choices import new_group
from lorastream.worker.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from lorastream.worker.engine.sampling import SamplingParams, make_generator
from lorastream.worker.engine.sequence import RequestStream, Sequence
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.kv_cache import BlockAllocator

if TYPE_CHECKING:
    from lorastream.worker.engine.grammar import GrammarCompiler, GrammarMatcher


class RequestIntake:
    def __init__(
        self, tokenizer: Tokenizer, config: ModelConfig, *, max_seq_len: int, kv_blocks: int,
        default_max_tokens: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = config.name or "the base model"
        self.vocab_size = config.vocab_size
        self.max_seq_len = min(max_seq_len, config.max_position_embeddings)
        self.kv_blocks = kv_blocks
        self.default_max_tokens = default_max_tokens
        # End of sequence: the model's ids and the tokenizer's own, unless a request ignores EOS.
        eos = set(config.eos_token_ids)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            eos.add(int(tok_eos))
        self.eos_ids = frozenset(eos)
        self._grammar: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()

    @property
    def grammar(self) -> GrammarCompiler:
        """The worker's grammar compiler (built on first use; thread-safe)."""
        with self._grammar_lock:
            if self._grammar is None:
                from lorastream.worker.engine.grammar import GrammarCompiler

                self._grammar = GrammarCompiler(
                    self.tokenizer, self.vocab_size, sorted(self.eos_ids)
                )
            return self._grammar

    def matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """A fresh matcher for the request's constraint (None without one)."""
        return None if params.structured is None else self.grammar.matcher(params.structured)

    def tokenize(self, prompt: PromptInput) -> list[int]:
        """Token ids of a prompt given as ids, chat messages (the model's chat template, with
        the generation prompt) or plain text."""
        tok = self.tokenizer
        if prompt.token_ids is not None:
            ids = list(prompt.token_ids)
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                raise InvalidArgument(
                    f"prompt token ids {bad[:5]} are outside the vocabulary "
                    f"0..{self.vocab_size - 1}"
                )
        elif prompt.messages is not None:
            ids = list(render_chat(tok, self.model_name, prompt, tokenize=True))
        else:
            ids = list(tok(prompt.text or "").input_ids)  # type: ignore[operator]  # a transformers tokenizer, typed object
        if not ids:
            raise InvalidArgument("the prompt is empty")
        return ids

    def sequence(
        self, prompt: PromptInput, params: SamplingParams,
        resolve_adapter: Callable[[], str | None], request_id: str | None = None,
        invocation_of: Callable[[str], tuple[int, ...]] | None = None,
        resolve_mix: Callable[[], tuple[tuple[str, float], ...]] | None = None,
    ) -> Sequence:
        """A validated sequence for the request; raises domain errors for bad input. The
        adapter is resolved to its content id (which may ask the store) only once the cheap
        checks passed. ``invocation_of``: an adapter's activated-LoRA invocation tokens (()
        for a plain LoRA), which set where its delta starts (``activation.py``).
        ``resolve_mix``: for a weighted mix, its components' content ids and weights (then
        ``resolve_adapter`` is not called)."""
        if params.max_tokens == 0:  # unset on the wire: this worker's default
            params = dataclasses.replace(params, max_tokens=self.default_max_tokens)
        params.validate(self.vocab_size)
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_seq_len:
            raise InvalidArgument(
                f"the prompt has {len(ids)} tokens; this worker's context is {self.max_seq_len} "
                "tokens (prompt + completion): shorten the prompt"
            )
        max_len = min(len(ids) + params.max_tokens, self.max_seq_len)
        group = new_group(params.n, len(ids), max_len)
        need = BlockAllocator.blocks_for(max_len if group is None else group.reserve_tokens)
        if need > self.kv_blocks:  # no retry can help: a client error, not a busy server
            raise InvalidArgument(
                f"the request needs {need} KV cache blocks (prompt + max_tokens, for each of its "
                f"n choices) but the whole cache has {self.kv_blocks}; lower max_tokens or n, or "
                "start the worker with a larger --kv-cache-bytes"
            )
        matcher = self.matcher(params)  # a bad constraint: 400, nothing queued
        mix = resolve_mix() if resolve_mix is not None else ()
        adapter_id = None if resolve_mix is not None else resolve_adapter()
        stream = RequestStream(request_id or uuid.uuid4().hex)
        seq = Sequence(
            request_id=stream.request_id,
            prompt_ids=ids,
            params=params,
            adapter_id=adapter_id,
            stream=stream,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, stop=params.stop),
            generator=make_generator(params.seed),
            max_len=max_len,
            eos_ids=frozenset() if params.ignore_eos else self.eos_ids,
            group=group,
            matcher=matcher,
            mix=mix,
        )
        if adapter_id is not None and invocation_of is not None:
            seq.lora_from = activation_start(ids, invocation_of(adapter_id))
        if group is not None:
            group.members.append(seq)
        return seq
