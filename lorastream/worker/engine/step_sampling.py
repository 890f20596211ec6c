"""One step's sampling: from the forward pass's logits to a token for every sampling row.

The engine hands over the step's logits [n, V], one row per sequence that samples this step
(``StepInputs.samplers``), and gets back, on the host, each row's sequence and token and the
logprobs of the rows that asked for them. On the way:

- n > 1: a request whose prompt just completed forks its other choices (``choices.py``); each
  samples from its parent's logits row, so that row repeats;
- each row becomes a :class:`SamplingRow`: its token history is made at its first sample when its
  penalties need one, and EOS and its stop token ids are masked until it has ``min_tokens``;
- the rows with an output constraint get their grammar's mask;
- the sampler draws, and the tokens come back in the step's one device -> host transfer.

Streaming the tokens, retiring finished sequences and the step's stats stay with the engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lorastream.worker.engine.choices import expand_for_choices
from lorastream.worker.engine.logits_processors import TokenHistory, host_values, needs_history
from lorastream.worker.engine.sampling import Sampler, SamplingRow
from lorastream.worker.engine.sequence import Sequence

if TYPE_CHECKING:
    from lorastream.worker.engine.grammar import LogitMasks

__all__ = ["StepTokens", "grammar_mask", "sample_step", "sampling_row"]


@dataclass(frozen=True)
class StepTokens:
    """One step's sampled tokens, on the host: one per sampling row."""

    sequences: list[Sequence]  # each row's sequence: the step's samplers and any new choices
    tokens: list[int]
    logprobs: dict[int, tuple[float, list[tuple[int, float]]]]  # row -> (chosen, top k), if asked


def sample_step(
    sampler: Sampler,
    logits: torch.Tensor,
    samplers: list[Sequence],
    fork: Callable[[Sequence], list[Sequence]],
    grammar: Callable[[], LogitMasks],
) -> StepTokens:
    """logits [n, V]: one row per sequence of ``samplers``. ``fork(parent)`` makes a request's
    other choices and runs them; ``grammar()`` is the worker's grammar compiler, asked for only
    when a row is constrained."""
    # n > 1: a request whose prompt just completed forks; its logits row serves each choice
    sequences, logit_rows = expand_for_choices(samplers, fork)
    if logit_rows is not None:
        logits = logits.index_select(0, host_values(logit_rows, torch.long, logits.device))
    sampled = sampler.step(
        logits, [sampling_row(s, logits) for s in sequences], grammar_mask(sequences, grammar)
    )
    tokens = sampled.tokens.tolist()  # the one device -> host transfer of the step
    logprobs = sampled.logprobs.to_host() if sampled.logprobs is not None else {}
    return StepTokens(sequences, tokens, logprobs)


def sampling_row(seq: Sequence, logits: torch.Tensor) -> SamplingRow:
    """logits [B, V]: the step's, for their vocabulary width and device."""
    params = seq.params
    if seq.history is None and needs_history(params):
        seq.history = TokenHistory(
            seq.prompt_ids, seq.output_ids, logits.shape[-1], logits.device
        )
    generated = len(seq.output_ids)
    stop_ids = (
        seq.eos_ids | frozenset(params.stop_token_ids)
        if generated < params.min_tokens else frozenset()
    )
    return SamplingRow(params, seq.generator, seq.history, generated, stop_ids)


def grammar_mask(
    sequences: list[Sequence], grammar: Callable[[], LogitMasks]
) -> Callable[[torch.Tensor], None] | None:
    """The grammar mask of the step's constrained rows (None when every row is free).

    It runs after penalties, logit bias and min_tokens, so the draw, greedy argmax and
    logprobs all see the masked logits; free rows are untouched.
    """
    rows = [(i, seq.matcher) for i, seq in enumerate(sequences) if seq.matcher is not None]
    if not rows:
        return None
    return functools.partial(grammar().mask_, rows=rows)
