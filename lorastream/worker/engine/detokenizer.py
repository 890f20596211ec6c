"""Incremental detokenization with stop strings: token ids in, streamable text deltas out.

Two stages hold text back until it is final:

1. **Decoding** (vLLM's ``detokenize_incrementally`` with ``prefix_offset``/``read_offset``). Each
   step decodes a small window of recent ids: the *context* tokens (those of the previous release,
   already turned into text) plus the *new* tokens. Only what the new tokens add is released::

       window = [ ▁Hello | ▁wor  ld ]        decode(window) = "Hello world"
                 context   new               decode(context) = "Hello"  -> delta " world"

   The context keeps SentencePiece's leading space of ``▁wor`` (a decoder's ``Strip`` eats the
   leading space of the first token of whatever it decodes) and starts on a character boundary.
   New tokens are held, and the window grows, while their text ends in U+FFFD (an incomplete UTF-8
   sequence: a byte-fallback token like <0xE4> or a byte-level BPE piece of a character) or adds
   nothing (a skipped special token). Each step decodes O(window) ids, so the cost per token is
   O(1) however long the output gets.

2. **Stop strings** (OpenAI semantics: the stop string is not part of the output). Decoded text
   whose tail could be the start of a stop string is held (``_pending``) until the next text
   disambiguates it; a stop string can therefore span any number of tokens. When several stop
   strings complete in the same delta, the one that completes first (then the longer one) wins,
   as if the text had arrived one character at a time.

Invariant (tested): the released text equals ``tokenizer.decode(generated_ids,
skip_special_tokens=True)``, truncated before the first stop string when one is hit. Two bounded
exceptions: a run of more than ``MAX_HELD_TOKENS`` tokens that never renders cleanly is released as
it stands (bounding the window); and a byte-fallback run that turns out invalid is rendered by the
``ByteFallback`` decoder as one U+FFFD per byte *including its already valid leading bytes* (e.g.
<0x0A><0xE4> -> "\ufffd\ufffd"), while we have already released those valid characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lorastream.core.errors import InvalidArgument

REPLACEMENT_CHAR = "\ufffd"
MAX_HELD_TOKENS = 16
"""New tokens held at most before their text is released as it stands (U+FFFD included)."""


class Tokenizer(Protocol):
    """What the detokenizer needs of a tokenizer (an HF ``PreTrainedTokenizer[Fast]``)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs: Any) -> str:
        """Text of ``token_ids``."""
        ...


@dataclass(frozen=True)
class DetokenizerStep:
    """What one generated token released."""

    delta: str
    """Text that can be streamed now (possibly empty)."""
    stopped: bool
    """A stop string was hit: ``delta`` ends just before it and nothing more will be released."""


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas; see the module docstring."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        """Detokenize one sequence.

        Args:
            tokenizer: decodes ids; an HF tokenizer.
            prompt_token_ids: the request's prompt. It is not decoding context: the output is the
                decode of the generated ids alone, as HF ``skip_prompt`` streamers and the OpenAI
                API define it (with the prompt as context, the first generated token's
                SentencePiece leading space would appear in the output).
            stop: stop strings; the output ends just before the first one.
            skip_special_tokens: as in ``tokenizer.decode``.
        """
        if isinstance(stop, str):
            raise InvalidArgument("stop must be a list of strings, got a single string")
        if any(not s for s in stop):
            raise InvalidArgument("stop strings must not be empty; remove the empty string")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._window: list[int] = []  # [context tokens | new tokens]
        self._read = 0  # window[:_read] is the context, window[_read:] the new tokens
        self._context_chars = 0  # len(decode(window[:_read]))
        self._pending = ""  # decoded text held back: it may be the start of a stop string
        self._text = ""
        self._stopped = False
        self._flushed = False

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer it decodes with (an adapter's own, or the base model's)."""
        return self._tokenizer

    @property
    def text(self) -> str:
        """All text released so far."""
        return self._text

    @property
    def stopped(self) -> bool:
        """A stop string was hit."""
        return self._stopped

    def push(self, token_id: int) -> DetokenizerStep:
        """Add one generated token; return the text that can be released now."""
        if self._flushed:
            raise RuntimeError("push() after flush(): the sequence is finished")
        if self._stopped:
            return DetokenizerStep("", True)
        self._window.append(token_id)
        return self._release(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """At the end of generation: release everything held back (unless a stop string was hit).

        An incomplete UTF-8 sequence is released as the decoder renders it (U+FFFD). A stop
        string completed by the flushed text still truncates it. Later calls return ''.
        """
        if self._flushed:
            return ""
        self._flushed = True
        if self._stopped:
            return ""
        return self._release(self._decode_new(final=True), final=True).delta

    def _decode(self, token_ids: list[int]) -> str:
        # Cleanup of tokenization spaces rewrites text already streamed (" ." -> "."): never here.
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_new(self, final: bool) -> str:
        """Text the new tokens add, or '' while it may still change."""
        if self._read == len(self._window):
            return ""
        text = self._decode(self._window)
        unsettled = len(text) <= self._context_chars or text.endswith(REPLACEMENT_CHAR)
        if unsettled and not final and len(self._window) - self._read < MAX_HELD_TOKENS:
            return ""
        delta = text[self._context_chars :]
        # The new tokens become the next step's context.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._context_chars = len(self._decode(self._window))
        return delta

    def _release(self, delta: str, final: bool) -> DetokenizerStep:
        """Pass decoded text through the stop-string stage."""
        if not self._stop:
            self._text += delta
            return DetokenizerStep(delta, False)
        buffer = self._pending + delta
        cut = first_stop(buffer, self._stop)
        if cut is not None:
            released, self._pending, self._stopped = buffer[:cut], "", True
        else:
            held = 0 if final else stop_prefix_len(buffer, self._stop)
            released, self._pending = buffer[: len(buffer) - held], buffer[len(buffer) - held :]
        self._text += released
        return DetokenizerStep(released, self._stopped)


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where ``text`` must be cut: before the stop string that completes first (then the longest).

    >>> first_stop("abcd", ["abcd", "bc"])  # "bc" is complete one character before "abcd"
    1
    """
    best: tuple[int, int] | None = None  # (end, start)
    for s in stop:
        start = text.find(s)
        if start >= 0 and (best is None or (start + len(s), start) < best):
            best = (start + len(s), start)
    return None if best is None else best[1]


def stop_prefix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.

    >>> stop_prefix_len("say </st", ["</stop>"])
    4
    """
    if not text:
        return 0
    best = 0
    last = text[-1]
    for s in stop:
        # Candidate lengths n end where s[n - 1] == text[-1]; try the longest first.
        n = s.rfind(last, 0, min(len(s) - 1, len(text)))
        while n + 1 > best:
            if text.endswith(s[: n + 1]):
                best = n + 1
                break
            n = s.rfind(last, 0, n)
    return best
