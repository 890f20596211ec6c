"""Structured outputs: compile a request's constraint for the tokenizer, mask each step's logits.

The grammar engine is llguidance (chosen over xgrammar on measured cost on this CPU and on what it
pulls in; ``lorastream bench grammar`` runs both side by side and docs/gateway-api.md gives the
figures). One :class:`GrammarCompiler` per tokenizer (the base model's, each adapter's own) turns
a :class:`StructuredOutput` into a :class:`GrammarMatcher` per request; each step the engine asks
the matchers of the constrained rows for their masks (one :class:`LogitMasks`, whichever tokenizer
each matcher was compiled for), samples, and feeds each matcher its token
(:meth:`GrammarMatcher.accept`). Free rows are not touched, so constrained and free requests, with
different adapters, share one batch.

On a GPU the masks are filled on the host and reach the device in one non-blocking copy of a
small int32 bitmask ([R, ceil(V / 32)]); the token the matcher needs is the one the step already
brings to the host.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import torch

from lorastream.core.errors import InvalidArgument
from lorastream.core.structured import StructuredKind, StructuredOutput

log = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)  # [32] bit positions of one bitmask word


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bitmask [R, W] -> bool [R, vocab]: True where the token is allowed.

    Semantics::

        allowed[r, v] = (bitmask[r, v // 32] >> (v % 32)) & 1 == 1     for v < min(vocab, 32 W)
        allowed[r, v] = False                                          for 32 W <= v < vocab
    """
    rows, words = bitmask.shape
    bits = (bitmask[:, :, None] >> _BITS.to(bitmask.device)) & 1  # [R, W, 32]
    allowed = bits.reshape(rows, words * 32)[:, :vocab].bool()  # [R, min(V, 32 W)]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return allowed


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next, and what came."""

    def __init__(self, matcher: llguidance.LLMatcher, param: str) -> None:
        self._matcher = matcher
        self._param = param

    def fill(self, row: torch.Tensor) -> None:
        """Write the allowed-token bitmask of the next step into ``row`` ([W] int32, host)."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token: int) -> None:
        """Advance past ``token`` (sampled from a masked row, so the grammar allows it)."""
        if not self._matcher.consume_token(token):
            # Only a bug can get here (the token was masked in); never emit off-grammar output.
            raise InvalidArgument(
                f"{self._param}: token {token} broke the output constraint "
                f"({self._matcher.get_error() or 'rejected'})"
            )

    def fork(self) -> GrammarMatcher:
        """An independent matcher at the same position (another choice of the request)."""
        return GrammarMatcher(self._matcher.deep_copy(), self._param)

    @property
    def finished(self) -> bool:
        """True once nothing may follow: the output is complete (the request ends with "stop")."""
        return self._matcher.is_stopped()


class _DecodedTokens:
    """What llguidance's TokenizerWrapper reads of a tokenizer, from each token decoded alone.

    For tokenizers whose decoder llguidance cannot read from tokenizer.json; exact when every
    token decodes to whole characters (the tiny test models' character-level tokenizer). Ids
    past the logits (``n_vocab``; a pad token added after the last row) are left out: they can
    never be sampled, and the masks stay ``n_vocab`` wide.
    """

    def __init__(self, hf_tokenizer: Any, n_vocab: int) -> None:
        self._tokenizer = hf_tokenizer
        self.eos_token_id = hf_tokenizer.eos_token_id
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.special_token_ids = list(hf_tokenizer.all_special_ids)
        special = set(self.special_token_ids)
        self.tokens = [
            (hf_tokenizer.convert_ids_to_tokens(i) if i in special
             else hf_tokenizer.decode([i])).encode()
            for i in range(min(len(hf_tokenizer), n_vocab))
        ]

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


class LogitMasks:
    """Applies matchers' masks to a step's logits, in one host bitmask reused across steps.

    Matchers compiled for different tokenizers (the base model's, adapters' own) share it: a
    mask is a set of token ids of the model's ``vocab_size`` logits.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._bitmask = torch.empty(0, dtype=torch.int32)

    @property
    def words(self) -> int:
        """int32 words of one row's bitmask."""
        return (self.vocab_size + 31) // 32

    def mask_(
        self, logits: torch.Tensor, rows: Sequence[tuple[int, GrammarMatcher]]
    ) -> None:
        """In place: logits [B, V] get -inf wherever row ``i``'s matcher forbids the token.

        Semantics::

            for (i, m) in rows: logits[i, v] = -inf  for every v that m does not allow next

        Rows not named are left exactly as they are.
        """
        if not rows:
            return
        count, vocab = len(rows), logits.shape[1]
        if self._bitmask.shape[0] < count:
            self._bitmask = torch.empty(count, self.words, dtype=torch.int32)
        bitmask = self._bitmask[:count]  # [R, W] host
        for r, (_, matcher) in enumerate(rows):
            matcher.fill(bitmask[r])
        index = torch.tensor([i for i, _ in rows], dtype=torch.long)  # [R]
        allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), vocab)  # [R, V]
        index = index.to(logits.device, non_blocking=True)
        selected = logits.index_select(0, index)  # [R, V]
        logits.index_copy_(0, index, selected.masked_fill_(~allowed, float("-inf")))


class GrammarCompiler:
    """Compiles constraints for one tokenizer; keeps the last ``cache_size`` compiled grammars.

    ``vocab_size`` is the width of the model's logits (it may exceed the tokenizer's length; the
    ids past it are never allowed). Thread-safe: requests compile on their own threads.
    """

    def __init__(
        self,
        hf_tokenizer: Any,  # a transformers tokenizer: llguidance reads its backend
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        cache_size: int = 256,
    ) -> None:
        self.vocab_size = vocab_size
        eos = list(eos_token_ids) or None
        try:
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf_tokenizer, n_vocab=vocab_size, eos_token=eos
            )
        except ValueError as exc:  # a decoder llguidance does not know (e.g. a Fuse decoder)
            log.info("llguidance cannot read the tokenizer (%s); using its decoded tokens", exc)
            self._tokenizer = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_DecodedTokens(hf_tokenizer, vocab_size)),
                n_vocab=vocab_size, eos_token=eos,
            )
        self._cache: OrderedDict[tuple[StructuredKind, str], str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._masks = LogitMasks(vocab_size)

    @property
    def words(self) -> int:
        """int32 words of one row's bitmask."""
        return self._masks.words

    def matcher(self, output: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for ``output``; raises InvalidArgument naming its parameter."""
        output.validate()
        grammar = self._grammar(output)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar)
        if matcher.is_error():
            raise InvalidArgument(f"{output.param}: {matcher.get_error()}")
        return GrammarMatcher(matcher, output.param)

    def _grammar(self, output: StructuredOutput) -> str:
        key = (output.kind, output.spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            if output.kind is StructuredKind.JSON_SCHEMA:
                # Compact JSON (", " and ": " between items): free whitespace lets a small model
                # loop on blanks. A schema may override it with llguidance's "x-guidance" keys.
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    output.spec, defaults={"whitespace_flexible": False}
                )
            elif output.kind is StructuredKind.REGEX:
                grammar = llguidance.LLMatcher.grammar_from_regex(output.spec)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(output.spec)
        except ValueError as exc:
            raise InvalidArgument(f"{output.param}: {exc}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._tokenizer
        )
        if is_error:
            raise InvalidArgument(f"{output.param}: {'; '.join(messages)}")
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def mask_(
        self, logits: torch.Tensor, rows: Sequence[tuple[int, GrammarMatcher]]
    ) -> None:
        """:meth:`LogitMasks.mask_` with this compiler's own buffer."""
        self._masks.mask_(logits, rows)
