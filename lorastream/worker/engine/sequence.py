"""One generation request as the engine tracks it, and the stream its events go back through."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lorastream.core.errors import LorastreamError
from lorastream.core.generation import GenerationEvent
from lorastream.worker.engine.detokenizer import IncrementalDetokenizer
from lorastream.worker.engine.logits_processors import TokenHistory
from lorastream.worker.engine.sampling import SamplingParams
from lorastream.worker.lora.backend import RowLora

if TYPE_CHECKING:  # llguidance is imported only once a request asks for a constraint
    from lorastream.worker.engine.grammar import GrammarMatcher


class RequestStream:
    """The consumer side of a request: events, then the end (or the error that ended it)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: queue.SimpleQueue[GenerationEvent | LorastreamError | None] = (
            queue.SimpleQueue()
        )
        self.cancelled = threading.Event()

    def put(self, item: GenerationEvent | LorastreamError | None) -> None:
        self._queue.put(item)

    def cancel(self) -> None:
        """Ask the engine to drop the request (the client went away)."""
        self.cancelled.set()

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> GenerationEvent:
        item = self._queue.get()
        if item is None:
            raise StopIteration
        if isinstance(item, LorastreamError):
            raise item
        return item


@dataclass(eq=False)
class ChoiceGroup:
    """The n choices of one request (n > 1): one stream, the prompt's KV blocks shared.

    The request is admitted as one sequence (choice 0) that reserves the KV blocks of all n;
    once its prompt is prefilled it forks into n (choices.py).
    """

    n: int
    reserve_tokens: int  # KV tokens reserved at admission for all n choices
    members: list[Sequence] = field(default_factory=list)
    forked: bool = False

    def retire(self, seq: Sequence) -> bool:
        """``seq`` finished; True when it was the group's last live sequence."""
        seq.finished = True
        return all(m.finished for m in self.members)


@dataclass(eq=False)
class Sequence:
    """Engine-side state of one request. Only the engine thread mutates it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter_id: str | None  # its adapter's content id (resolved once, at intake); None: base
    # or a mix
    stream: RequestStream
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    max_len: int  # prompt + generated tokens never exceed this (context or max_tokens)
    eos_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    # prefix caching (prefix_cache.py): prompt tokens taken from the cache at admission, hashes
    # of its full blocks computed so far, and how many of its blocks are registered (or reused)
    cached_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    registered_blocks: int = 0
    slot: int = -1  # LoRA slot while running, -1 for the base model (and a mix)
    # a weighted mix (core/adapter_mix.py): (content id, weight) of each component, () if none;
    # while running, (slot, weight) of each
    mix: tuple[tuple[str, float], ...] = ()
    mix_slots: tuple[tuple[int, float], ...] = ()
    # the first position whose row takes the adapter's delta: 0 but for an activated LoRA, whose
    # rows before its invocation run the base model (activation.py)
    lora_from: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    history: TokenHistory | None = None  # device-side token counts, made at its first sample
    choice: int = 0  # its index among the request's n choices
    group: ChoiceGroup | None = None  # n > 1 only
    finished: bool = False  # retired or failed (the engine puts nothing more on its stream)
    matcher: GrammarMatcher | None = None  # structured outputs: its own place in the grammar

    @property
    def reserve_tokens(self) -> int:
        """KV tokens to reserve at admission (every choice's, for n > 1)."""
        return self.max_len if self.group is None else self.group.reserve_tokens

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def remaining_prompt(self) -> int:
        return len(self.prompt_ids) - self.num_computed

    @property
    def adapter_ids(self) -> tuple[str, ...]:
        """The adapters it references, places and waits for: its adapter, a mix's components,
        or none (the base model)."""
        if self.mix:
            return tuple(adapter_id for adapter_id, _ in self.mix)
        return () if self.adapter_id is None else (self.adapter_id,)

    def place(self, slots: list[int]) -> None:
        """Its step slots, one per :attr:`adapter_ids` (``[-1]`` for the base model)."""
        if self.mix:
            self.mix_slots = tuple((s, w) for s, (_, w) in zip(slots, self.mix, strict=True))
        else:
            self.slot = slots[0]

    def lora_slot(self, position: int) -> int:
        """The LoRA slot of the row at ``position``: -1 for the base model (no adapter, or an
        activated LoRA before its invocation) and for a mix (:meth:`lora_row`)."""
        return self.slot if position >= self.lora_from else -1

    def lora_row(self, position: int) -> RowLora:
        """What the row at ``position`` takes: :meth:`lora_slot`, or a mix's slots and weights."""
        return self.mix_slots if self.mix else self.lora_slot(position)

    def token_at(self, index: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[index] if index < n else self.output_ids[index - n]

    @property
    def cancelled(self) -> bool:
        return self.stream.cancelled.is_set()
