"""Logits processing before the sampler's draw: penalties, logit bias, min_tokens, logprobs.

Order within one step, per row (each stage only touches the rows whose request asked for it)::

    logits  --repetition penalty--> --frequency / presence penalties--> --logit bias-->
            --min_tokens mask-->  processed   (log-probabilities are taken here)
            --temperature, top-k, top-p, draw (sampling.py)--> token

This is HF ``generate``'s order for the processors it has (``RepetitionPenaltyLogitsProcessor``
before ``MinNewTokensLengthLogitsProcessor`` before ``SequenceBiasLogitsProcessor``; the bias and
the mask commute) with OpenAI's penalties right after HF's, as vLLM applies them together.

Nothing here reads a device tensor on the host: per-row parameters are built from the requests'
host-side values, and each sequence's token counts live on the device (:class:`TokenHistory`),
updated there from the sampled token tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lorastream.core.generation import SamplingParams, TokenLogprobs, TopLogprob


class TokenHistory:
    """The tokens one sequence has seen, on the logits' device, for its penalties.

    Semantics::

        prompt_mask[v]   = v in prompt_ids                    # [V] bool
        output_counts[v] = output_ids.count(v)                # [V] float32
    """

    def __init__(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], vocab: int,
        device: torch.device,
    ) -> None:
        self.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)  # [V]
        self.prompt_mask[host_values(list(prompt_ids), torch.long, device)] = True
        self.output_counts = torch.zeros(vocab, device=device)  # [V]
        self._one = torch.ones(1, device=device)  # [1]
        if output_ids:
            ids = host_values(list(output_ids), torch.long, device)
            self.output_counts.index_add_(0, ids, self._one.expand(len(output_ids)))

    def record(self, token: torch.Tensor) -> None:
        """Count one generated token: ``token`` [1] int64, on the device (no host read)."""
        self.output_counts.index_add_(0, token, self._one)


class LogitsRow(Protocol):
    """What processing needs of one row (sampling.SamplingRow provides it)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def history(self) -> TokenHistory | None: ...

    @property
    def generated(self) -> int: ...

    @property
    def stop_ids(self) -> frozenset[int]: ...


def needs_history(params: SamplingParams) -> bool:
    """True when the request's penalties read its token counts."""
    return bool(
        params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
    )


def apply_penalties_(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """In place: HF's repetition penalty, then OpenAI's frequency and presence penalties.

    Semantics (per row i, token v)::

        if prompt_mask[i, v] or output_counts[i, v] > 0:          # HF: prompt + generated
            logits[i, v] = logits[i, v] / repetition[i] if logits[i, v] > 0
                           else logits[i, v] * repetition[i]
        logits[i, v] -= frequency[i] * output_counts[i, v]          # OpenAI: generated only
        logits[i, v] -= presence[i] * (output_counts[i, v] > 0)

    Args:
        logits: [P, V] float32; overwritten.
        prompt_mask: [P, V] bool.
        output_counts: [P, V] float32.
        repetition, frequency, presence: [P] float32 (1, 0, 0 disable).
    Returns:
        ``logits``.
    """
    generated = output_counts > 0  # [P, V]
    seen = prompt_mask | generated  # [P, V]
    rep = repetition[:, None]  # [P, 1]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)  # [P, V]
    logits.copy_(torch.where(seen, penalised, logits))
    logits.sub_(frequency[:, None] * output_counts)
    return logits.sub_(presence[:, None] * generated)


def process_logits_(logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
    """In place: every row's penalties, logit bias and min_tokens mask (see the module docstring).

    Args:
        logits: [B, V] float32, one row per entry of ``rows``; rows without processing are left
            as they are.
    Returns:
        ``logits``.
    """
    device = logits.device
    penalised = [i for i, row in enumerate(rows) if row.history is not None]
    if penalised:
        index = host_values(penalised, torch.long, device)  # [P]
        histories = [rows[i].history for i in penalised]
        params = [rows[i].params for i in penalised]
        sub = apply_penalties_(
            logits.index_select(0, index),  # [P, V]
            torch.stack([h.prompt_mask for h in histories if h is not None]),  # [P, V]
            torch.stack([h.output_counts for h in histories if h is not None]),  # [P, V]
            _floats([q.repetition_penalty for q in params], device),
            _floats([q.frequency_penalty for q in params], device),
            _floats([q.presence_penalty for q in params], device),
        )
        logits.index_copy_(0, index, sub)
    bias = [(i, t, b) for i, row in enumerate(rows) for t, b in row.params.logit_bias]
    if bias:
        where = _pairs([(i, t) for i, t, _ in bias], device)  # ([N], [N])
        logits.index_put_(where, _floats([b for *_, b in bias], device), accumulate=True)
    banned = [
        (i, t) for i, row in enumerate(rows)
        if row.generated < row.params.min_tokens for t in row.stop_ids
    ]
    if banned:
        logits.index_put_(_pairs(banned, device), logits.new_tensor(float("-inf")))
    return logits


def record_tokens(rows: Sequence[LogitsRow], tokens: torch.Tensor) -> None:
    """Count each row's sampled token (tokens [B] int64 on the device) in its history."""
    for i, row in enumerate(rows):
        if row.history is not None:
            row.history.record(tokens[i : i + 1])


@dataclass(frozen=True)
class BatchLogprobs:
    """Log-probabilities of the rows that asked for them, still on the device.

    rows: batch row of each entry (host); top_k: how many top entries each row asked for (host);
    chosen [L] float32: the sampled token's; top_values, top_ids [L, K]: the K = max(top_k)
    most likely tokens of each row, most likely first.
    """

    rows: list[int]
    top_k: list[int]
    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def to_host(self) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        """batch row -> (sampled token's logprob, [(token id, logprob)] of its top k).

        Reads the device: call it after the step's tokens were read (no extra sync)."""
        chosen = self.chosen.tolist()
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        return {
            row: (chosen[j], list(zip(ids[j][:k], values[j][:k], strict=True)))
            for j, (row, k) in enumerate(zip(self.rows, self.top_k, strict=True))
        }


def token_logprobs(
    token: int, values: tuple[float, list[tuple[int, float]]] | None,
    decode: Callable[[list[int]], str],
) -> TokenLogprobs | None:
    """One row of :meth:`BatchLogprobs.to_host` as the API type, each token decoded on its own
    (None when the row did not ask for logprobs)."""
    if values is None:
        return None
    chosen, top = values
    return TokenLogprobs(
        token, decode([token]), chosen, tuple(TopLogprob(t, decode([t]), lp) for t, lp in top)
    )


def compute_logprobs(
    processed: torch.Tensor, tokens: torch.Tensor, rows: Sequence[LogitsRow]
) -> BatchLogprobs | None:
    """The log-probabilities each row asked for; None when no row did.

    Semantics (per asking row i; ``processed`` is after :func:`process_logits_`)::

        lp = log_softmax(processed[i])            # float32, over the whole vocabulary
        chosen[i] = lp[tokens[i]]
        top[i]    = the k = params.logprobs largest entries of lp, descending

    Args:
        processed: [B, V] float32 logits.
        tokens: [B] int64 sampled tokens.
    """
    asking = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not asking:
        return None
    top_k = [rows[i].params.logprobs or 0 for i in asking]
    index = host_values(asking, torch.long, processed.device)  # [L]
    lp = torch.log_softmax(processed.index_select(0, index).float(), dim=-1)  # [L, V]
    chosen = lp.gather(1, tokens.index_select(0, index)[:, None]).squeeze(1)  # [L]
    top = lp.topk(max(top_k), dim=-1)  # [L, K]
    return BatchLogprobs(asking, top_k, chosen, top.values, top.indices)


def host_values(
    values: Sequence[Any] | torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Per-row values built on the host (a list, or a host tensor), on ``device`` without a
    host sync.

    On CUDA, a plain ``torch.tensor(values, device=...)`` copies from pageable memory and waits
    for the stream (the step's forward pass); from pinned memory the copy is asynchronous.
    """
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _floats(values: Iterable[float], device: torch.device) -> torch.Tensor:
    return host_values(list(values), torch.float32, device)


def _pairs(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row indices [N], token indices [N]) for ``index_put_``."""
    both = host_values(pairs, torch.long, device)  # [N, 2]
    return both[:, 0], both[:, 1]
