"""Request intake, on the request threads: turn a prompt and sampling parameters into a
:class:`Sequence` the scheduler can run, or raise a clear error (nothing is queued then).

Checked here, before a request ever reaches the step loop: sampling parameters, token ids
inside the vocabulary, a chat template for chat prompts, a non-empty prompt that fits the
context, and a KV cache large enough for prompt + ``max_tokens``. A structured-output constraint
is compiled here too (a bad schema, regex or grammar is refused, naming its parameter), by the
:class:`~lorastream.worker.engine.grammar.GrammarCompiler` of the request's tokenizer: the base
model's, built at the first constrained request (llguidance reads the whole vocabulary), or an
adapter's own (``loading/tokenizers.py``), built at its first constrained request and kept as
long as the worker keeps that tokenizer.

An adapter with its own tokenizer also stops on its own end of sequence: its tokenizer's EOS,
added to its ``generation_config.json``'s ``eos_token_id`` if it ships one, else to the base
model's -- the base model's stop ids are derived the same way from its checkpoint.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from lorastream.core.errors import InvalidArgument
from lorastream.core.generation import PromptInput
from lorastream.worker.engine.activation import activation_start
from lorastream.worker.engine.chat_template import render_chat
from lorastream.worker.engine.choices import new_group
from lorastream.worker.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from lorastream.worker.engine.sampling import SamplingParams, make_generator
from lorastream.worker.engine.sequence import RequestStream, Sequence
from lorastream.worker.loading.tokenizers import AdapterTokenizer
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.kv_cache import BlockAllocator

if TYPE_CHECKING:
    from lorastream.worker.engine.grammar import GrammarCompiler, GrammarMatcher, LogitMasks


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
        self.model_eos_ids = tuple(config.eos_token_ids)
        self.eos_ids = _stop_ids(self.model_eos_ids, getattr(tokenizer, "eos_token_id", None))
        self._grammar: GrammarCompiler | None = None
        self._masks: LogitMasks | None = None
        # An adapter tokenizer's compiler lives as long as the worker keeps that tokenizer.
        self._adapter_grammars: weakref.WeakKeyDictionary[AdapterTokenizer, GrammarCompiler] = (
            weakref.WeakKeyDictionary())
        self._grammar_lock = threading.Lock()  # held while a compiler is built (seconds)
        self._masks_lock = threading.Lock()  # the step loop's: never waits on a compile

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

    @property
    def masks(self) -> LogitMasks:
        """The step loop's grammar masks, for matchers of any tokenizer (built on first use)."""
        with self._masks_lock:
            if self._masks is None:
                from lorastream.worker.engine.grammar import LogitMasks

                self._masks = LogitMasks(self.vocab_size)
            return self._masks

    def eos_of(self, own: AdapterTokenizer | None) -> frozenset[int]:
        """The stop ids of requests tokenized by ``own`` (an adapter's tokenizer; None: the
        base model's): its generation config's (else the model's) and its tokenizer's EOS."""
        if own is None:
            return self.eos_ids
        model = self.model_eos_ids if own.generation_eos is None else own.generation_eos
        return _stop_ids(model, own.eos_token_id)

    def grammar_for(self, own: AdapterTokenizer | None) -> GrammarCompiler:
        """The grammar compiler of ``own``'s tokenizer (None: the base model's)."""
        if own is None:
            return self.grammar
        with self._grammar_lock:
            compiler = self._adapter_grammars.get(own)
            if compiler is None:
                from lorastream.worker.engine.grammar import GrammarCompiler

                eos = sorted(i for i in self.eos_of(own) if i < self.vocab_size)  # sampled ones
                compiler = GrammarCompiler(own.tokenizer, self.vocab_size, eos)
                self._adapter_grammars[own] = compiler
            return compiler

    def matcher(self, params: SamplingParams, own: AdapterTokenizer | None = None
                ) -> GrammarMatcher | None:
        """A fresh matcher for the request's constraint (None without one), compiled for
        ``own`` (an adapter's tokenizer; None: the base model's)."""
        if params.structured is None:
            return None
        return self.grammar_for(own).matcher(params.structured)

    def tokenize(self, prompt: PromptInput, tokenizer: Tokenizer | None = None) -> list[int]:
        """Token ids of a prompt given as ids, chat messages (the model's chat template, with
        the generation prompt) or plain text, with ``tokenizer`` (an adapter's own; default the
        base model's)."""
        tok = tokenizer or self.tokenizer
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
        tokenizer_of: Callable[[str], AdapterTokenizer | None] | None = None,
        resolve_mix: Callable[[], tuple[tuple[str, float], ...]] | None = None,
    ) -> Sequence:
        """A validated sequence for the request; raises domain errors for bad input. The
        adapter is resolved to its content id (which may ask the store) only once the sampling
        parameters passed. ``invocation_of``: an adapter's activated-LoRA invocation tokens (()
        for a plain LoRA), which set where its delta starts (``activation.py``);
        ``tokenizer_of``: an adapter's own tokenizer (None: the base model's), which encodes
        the prompt, decodes the output, sets the stop ids and compiles the constraint;
        ``resolve_mix``: for a weighted mix, its components' content ids and weights (then
        ``resolve_adapter`` is not called, and the base model's tokenizer serves it)."""
        if params.max_tokens == 0:  # unset on the wire: this worker's default
            params = dataclasses.replace(params, max_tokens=self.default_max_tokens)
        params.validate(self.vocab_size)
        mix = resolve_mix() if resolve_mix is not None else ()
        adapter_id = None if resolve_mix is not None else resolve_adapter()
        own = tokenizer_of(adapter_id) if adapter_id is not None and tokenizer_of else None
        tokenizer = cast(Tokenizer, own.tokenizer) if own is not None else self.tokenizer
        ids = self.tokenize(prompt, tokenizer)
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
        matcher = self.matcher(params, own)  # a bad constraint: 400, nothing queued
        stream = RequestStream(request_id or uuid.uuid4().hex)
        seq = Sequence(
            request_id=stream.request_id,
            prompt_ids=ids,
            params=params,
            adapter_id=adapter_id,
            stream=stream,
            detokenizer=IncrementalDetokenizer(tokenizer, ids, stop=params.stop),
            generator=make_generator(params.seed),
            max_len=max_len,
            eos_ids=frozenset() if params.ignore_eos else self.eos_of(own),
            group=group,
            matcher=matcher,
            mix=mix,
        )
        if adapter_id is not None and invocation_of is not None:
            seq.lora_from = activation_start(ids, invocation_of(adapter_id))
        if group is not None:
            group.members.append(seq)
        return seq


def _stop_ids(model: tuple[int, ...], tokenizer_eos: int | None) -> frozenset[int]:
    return frozenset(model) | (frozenset() if tokenizer_eos is None else {int(tokenizer_eos)})
