"""Which worker last served a prompt's leading parts, per model: the gateway's prefix affinity.

A prompt is cut into chunks of ``CHUNK_CHARS`` characters (text, or a chat's messages as
``role\\0content\\0``...) or ``CHUNK_TOKENS`` token ids; its keys are the chained hashes of its
first 1, 2, ... n whole chunks (at most ``MAX_CHUNKS``). Semantics::

    keys(p)     = [h_n, ..., h_2, h_1]           # h_k = blake2b(h_{k-1} || chunk_k), longest first
    recorded(p) = h_n and every h_k with k a power of two   # at most 1 + log2(n) entries
    lookup(p)   = the worker of the first key of keys(p) in the table   # the longest known

A conversation's next turn extends its last prompt, so its keys include that prompt's ``h_n``
(its last whole chunk): the lookup finds the worker that served that turn, not another
conversation behind the same system prompt (whose last chunk differs). The power-of-two keys
let a new conversation find a worker that served the same system prompt. Prompts shorter than
one chunk have no keys.

The table maps (model, key) -> worker; at most ``capacity`` entries, least recently used dropped
first (0: off, nothing recorded).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from lorastream.core.generation import PromptInput

CHUNK_CHARS = 64
CHUNK_TOKENS = 16
MAX_CHUNKS = 1024  # 64 KiB of text, 16,384 token ids: past that, the same keys


def prefix_keys(prompt: PromptInput) -> tuple[str, ...]:
    """The chained hashes of ``prompt``'s whole chunks, the longest prefix first."""
    if prompt.token_ids is not None:
        ids = prompt.token_ids
        chunks = [",".join(map(str, ids[i:i + CHUNK_TOKENS])).encode()
                  for i in _chunk_starts(len(ids), CHUNK_TOKENS)]
    else:
        if prompt.messages is not None:
            text = "".join(f"{role}\0{content}\0" for role, content in prompt.messages)
        else:
            text = prompt.text or ""
        chunks = [text[i:i + CHUNK_CHARS].encode() for i in _chunk_starts(len(text), CHUNK_CHARS)]
    keys: list[str] = []
    digest = b""
    for chunk in chunks:
        digest = hashlib.blake2b(digest + chunk, digest_size=12).digest()
        keys.append(digest.hex())
    return tuple(reversed(keys))


def _chunk_starts(length: int, size: int) -> range:
    """Where each whole chunk of ``size`` starts in ``length`` items, at most ``MAX_CHUNKS``."""
    return range(0, min(length, size * MAX_CHUNKS) - size + 1, size)


def recorded_keys(keys: Sequence[str]) -> list[str]:
    """Of :func:`prefix_keys` (longest first), those a served request is remembered under."""
    n = len(keys)
    return [key for i, key in enumerate(keys) if i == 0 or (n - i) & (n - i - 1) == 0]


class PrefixAffinity:
    """(model, prefix key) -> the worker that served it last (module docstring)."""

    def __init__(self, capacity: int = 32768) -> None:
        self.capacity = capacity
        self._last: OrderedDict[tuple[str, str], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def last(self, model: str, key: str) -> str | None:
        return self._last.get((model, key))

    def lookup(self, model: str, keys: Sequence[str]) -> str | None:
        """The worker of the longest of ``keys`` (longest first) in the table, if any."""
        return next(filter(None, (self._last.get((model, key)) for key in keys)), None)

    def served(self, model: str, keys: Sequence[str], target: str) -> None:
        """``target`` served a prompt of ``model`` with these :func:`prefix_keys`."""
        if not self.capacity:
            return
        for key in recorded_keys(keys):
            self._last[(model, key)] = target
            self._last.move_to_end((model, key))
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
