"""The batched sampler of the decode step (``SamplingParams`` itself is in
lorastream.core.generation).

The sampler turns the last-position logits of every sequence in a batch into one token id each,
after the requests' penalties, logit bias and min_tokens mask (logits_processors.py) and, for the
rows with an output constraint, the grammar's mask (grammar.py, applied by the caller's
``constrain``):

* greedy rows (``temperature == 0``) take ``argmax`` (ties -> lowest index, exactly as
  ``torch.argmax`` and therefore HF ``generate(do_sample=False)``);
* sampled rows apply temperature, then top-k, then top-p (the semantics of HF's
  ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper``, in that order), then
  draw from the softmax of what is left.

Drawing uses inverse-CDF sampling in vocabulary order: ONE uniform number per row, from the row's
own ``torch.Generator`` when the request has a seed. A seeded request therefore consumes exactly one
draw per step whatever its batch companions are, and its token depends only on its own logits and
its own generator (up to last-bit float differences at a filter boundary, which a different batch
layout can shift). Nothing here loops over the vocabulary or sorts it: thresholds come from
``topk`` and the draw from block sums (see :func:`filter_weights_` and :func:`inverse_cdf`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# SamplingParams is part of the worker's API, shared with its clients: it lives in
# lorastream.core.generation and is re-exported here.
from lorastream.core.generation import GREEDY_TEMPERATURE, SamplingParams
from lorastream.worker.engine.logits_processors import (
    BatchLogprobs,
    TokenHistory,
    compute_logprobs,
    host_values,
    process_logits_,
    record_tokens,
)

__all__ = [
    "GREEDY_TEMPERATURE",
    "SampledBatch",
    "Sampler",
    "SamplingParams",
    "SamplingRow",
    "filter_weights_",
    "inverse_cdf",
    "make_generator",
]


def make_generator(seed: int | None) -> torch.Generator | None:
    """The request's own host generator (None without a seed: draw from the global generator).

    It stays on the host whatever the logits' device: it makes one uniform per step.
    """
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class SamplingRow:
    """One row of a sampling batch: the request's parameters and its generator (or None), and
    what its logits processing needs (logits_processors.py)."""

    params: SamplingParams
    generator: torch.Generator | None = None
    history: TokenHistory | None = None
    """Its token counts on the device; set exactly when its penalties need them."""
    generated: int = 0
    """Tokens it has generated before this step (for min_tokens)."""
    stop_ids: frozenset[int] = frozenset()
    """EOS and stop token ids: masked while ``generated < params.min_tokens``."""


@dataclass(frozen=True)
class SampledBatch:
    """One step's result, on the device: tokens [B] int64, and the log-probabilities of the
    rows that asked for them."""

    tokens: torch.Tensor
    logprobs: BatchLogprobs | None = None


def filter_weights_(
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    nucleus_guess: int = 256,
    mask_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """In place: temperature-scaled logits -> unnormalised probabilities of the tokens kept.

    Semantics (per row i; HF ``TopKLogitsWarper`` then ``TopPLogitsWarper``)::

        w[i, v] = exp(scaled[i, v] - max(scaled[i]))
        if 0 < top_k[i] < V: w[i, v] = 0 where w[i, v] < k-th largest of w[i]   (ties kept)
        if top_p[i] < 1:     walk tokens by descending w; keep a token while the mass of the ones
                             before it is < top_p[i] * sum(w[i]) (the first is always kept)

    Both filters keep the tokens at or above a per-row threshold weight taken from the tensor
    itself, found with a ``topk`` of width ``max(top_k)`` (``nucleus_guess`` for rows with top-p and
    no top-k) rather than a full sort; rows whose nucleus is wider than that are re-done with 8x
    the width until it fits. Exact ties at the nucleus boundary are all kept (HF keeps an arbitrary
    subset of them).

    Args:
        scaled: [S, V] float32 logits already divided by the temperature; overwritten.
        top_k: [S] int64, 0 = disabled.
        top_p: [S] float32 in (0, 1], 1 = disabled.
        nucleus_guess: candidates examined first for rows with top-p and no top-k.
        mask_out: optional [S, V] bool scratch space.
    Returns:
        ``scaled``, now [S, V] weights: exp(logit - row max) where kept, 0 where removed.
    """
    num_rows, vocab = scaled.shape
    weights = scaled.sub_(scaled.amax(-1, keepdim=True)).exp_()  # [S, V], row max is 1
    has_k = (top_k > 0) & (top_k < vocab)  # [S]
    has_p = top_p < 1  # [S]
    rows = (has_k | has_p).nonzero().squeeze(1)  # [F]
    if rows.numel() == 0:
        return weights
    every_row = rows.numel() == num_rows
    sub = weights if every_row else weights.index_select(0, rows)  # [F, V]
    k, p, has_k, has_p = top_k[rows], top_p[rows], has_k[rows], has_p[rows]  # [F] each
    width = int(k[has_k].max()) if bool(has_k.any()) else 0
    if bool((has_p & ~has_k).any()):
        width = max(width, nucleus_guess)
    width = min(width, vocab)

    row_mass = sub.sum(-1)  # [F]
    candidates = sub.topk(width, dim=-1).values  # [F, C] descending
    threshold, overflow = _thresholds(candidates, row_mass, k, has_k, p, has_p, vocab)  # [F]
    wide = overflow.nonzero().squeeze(1)  # [O] rows whose nucleus has more than C tokens
    while wide.numel() > 0:
        width = min(width * 8, vocab)
        candidates = sub[wide].topk(width, dim=-1).values  # [O, C]
        threshold[wide], overflow = _thresholds(
            candidates, row_mass[wide], k[wide], has_k[wide], p[wide], has_p[wide], vocab
        )
        wide = wide[overflow]
    if not every_row:
        threshold = weights.new_zeros(num_rows).index_copy_(0, rows, threshold)  # [S]
    mask = torch.lt(weights, threshold[:, None], out=mask_out)  # [S, V]
    return weights.masked_fill_(mask, 0.0)


def _thresholds(
    candidates: torch.Tensor,
    row_mass: torch.Tensor,
    k: torch.Tensor,
    has_k: torch.Tensor,
    p: torch.Tensor,
    has_p: torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest kept weight per row, and whether the C candidates were too few to tell.

    candidates [F, C]: each row's C largest weights, descending; row_mass [F]: sum of each row;
    k, has_k, p, has_p [F].
    """
    width = candidates.shape[1]
    zero = candidates.new_zeros(())
    kth = candidates.gather(1, (k.clamp(1, width) - 1)[:, None]).squeeze(1)  # [F]
    kth = torch.where(has_k, kth, zero)
    candidates = candidates.masked_fill(candidates < kth[:, None], 0.0)  # top-k
    # Mass of the top-k-filtered distribution: the candidates hold every top-k survivor.
    mass = torch.where(has_k, candidates.sum(-1), row_mass)  # [F]
    probs = candidates / mass[:, None]  # [F, C]
    mass_before = probs.cumsum(-1) - probs  # [F, C] mass of the more likely candidates
    keep = mass_before < p[:, None]
    keep[:, 0] = True
    kept = keep.sum(-1)  # [F] nucleus size: a prefix, since mass_before only grows
    nucleus = candidates.gather(1, (kept - 1)[:, None]).squeeze(1)  # [F]
    threshold = torch.maximum(kth, torch.where(has_p, nucleus, zero))
    only_p = has_p & ~has_k
    overflow = only_p & (kept == width) & (probs.sum(-1) < p) & (width < vocab)
    return threshold, overflow


def filter_weights_sync_free_(
    scaled: torch.Tensor,
    top_k: Sequence[int],
    top_p: Sequence[float],
    mask_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`filter_weights_` without reading the device: the same semantics and thresholds.

    Which rows filter, and how many candidates each needs, come from the host-side parameters:
    rows with top-k take a ``topk`` of width ``max(top_k)`` (every top-k survivor, hence their
    nucleus, is among them); rows with top-p and no top-k sort the whole row (their nucleus may
    be any size, and no host read may ask). The adaptive path's retry loop is what this avoids:
    on CUDA its ``nonzero`` and ``int(...)`` wait for the step. On the CPU the full sort costs
    more than the retries (the Sampler chooses by device).

    Args:
        scaled: [S, V] float32 logits already divided by the temperature; overwritten.
        top_k: S ints (host), 0 = disabled.
        top_p: S floats (host) in (0, 1], 1 = disabled.
        mask_out: optional [S, V] bool scratch space.
    Returns:
        ``scaled``, now [S, V] weights: exp(logit - row max) where kept, 0 where removed.
    """
    num_rows, vocab = scaled.shape
    weights = scaled.sub_(scaled.amax(-1, keepdim=True)).exp_()  # [S, V], row max is 1
    with_k = [i for i in range(num_rows) if 0 < top_k[i] < vocab]
    only_p = [i for i in range(num_rows) if top_p[i] < 1 and not 0 < top_k[i] < vocab]
    if not with_k and not only_p:
        return weights
    threshold = weights.new_zeros(num_rows)  # [S]
    for rows, width in ((with_k, max((top_k[i] for i in with_k), default=0)), (only_p, vocab)):
        if not rows:
            continue
        index = host_values(rows, torch.long, weights.device)  # [F]
        sub = weights if len(rows) == num_rows else weights.index_select(0, index)  # [F, V]
        candidates = (
            sub.sort(dim=-1, descending=True).values if width == vocab
            else sub.topk(width, dim=-1).values
        )  # [F, C] descending
        k = host_values([top_k[i] if rows is with_k else 0 for i in rows], torch.long,
                        weights.device)  # [F]
        p = host_values([top_p[i] for i in rows], torch.float32, weights.device)  # [F]
        found, _ = _thresholds(candidates, sub.sum(-1), k, k > 0, p, p < 1, vocab)  # [F]
        threshold.index_copy_(0, index, found)
    mask = torch.lt(weights, threshold[:, None], out=mask_out)  # [S, V]
    return weights.masked_fill_(mask, 0.0)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Per row, the first token whose cumulative weight exceeds ``u * total``.

    Semantics::

        cdf = cumsum(weights[i]); token[i] = min v such that cdf[v] > u[i] * cdf[-1]

    Done in two levels so that no [S, V] float64 cumsum is needed: float32 sums of blocks of
    ``block`` tokens, a float64 cumsum over blocks, then a float64 cumsum inside the chosen block.
    A token of weight 0 is never returned.

    Args:
        weights: [S, V] non-negative float32, every row with some positive weight.
        u: [S] float64 uniforms in [0, 1).
    Returns:
        [S] int64 token ids.
    """
    num_rows, vocab = weights.shape
    block = min(block, vocab)
    head = vocab // block * block
    sums = [weights[:, :head].reshape(num_rows, vocab // block, block).sum(-1)]  # [S, V // block]
    if head < vocab:
        sums.append(weights[:, head:].sum(-1, keepdim=True))
    block_cdf = torch.cat(sums, dim=1).double().cumsum(-1)  # [S, NB]
    total = block_cdf[:, -1]  # [S]
    target = torch.minimum(u * total, torch.nextafter(total, total.new_zeros(())))  # [S]
    chosen = torch.searchsorted(block_cdf, target[:, None], right=True)  # [S, 1]
    before = torch.where(
        chosen > 0, block_cdf.gather(1, (chosen - 1).clamp(min=0)), block_cdf.new_zeros(())
    ).squeeze(1)  # [S]
    columns = chosen * block + torch.arange(block, device=weights.device)  # [S, block]
    inside = weights.gather(1, columns.clamp(max=vocab - 1)).masked_fill(columns >= vocab, 0.0)
    cdf = inside.cumsum(-1, dtype=torch.float64)  # [S, block]
    rest = torch.minimum(target - before, torch.nextafter(cdf[:, -1], cdf.new_zeros(())))  # [S]
    offset = torch.searchsorted(cdf, rest[:, None], right=True)  # [S, 1]
    return (chosen * block + offset).squeeze(1)


class Sampler:
    """Picks the next token of every row of a batch; see the module docstring.

    Keeps [B, V] scratch buffers between steps (allocating 50 MB per step costs more than the
    arithmetic on it), so one sampler serves one decode loop at a time.
    """

    def __init__(self, nucleus_guess: int = 256) -> None:
        self.nucleus_guess = nucleus_guess
        """Candidates examined first (then 8x more, ...) for rows with top-p and no top-k."""
        self._weights = torch.empty(0)
        self._mask = torch.empty(0, dtype=torch.bool)

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow],
        constrain: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """logits [B, V] float32 (last position of each sequence); one SamplingRow per row.

        Returns token ids [B] int64. See :meth:`step`.
        """
        return self.step(logits, rows, constrain).tokens

    @torch.inference_mode()
    def step(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow],
        constrain: Callable[[torch.Tensor], None] | None = None,
    ) -> SampledBatch:
        """Process, pick and count one token per row; nothing is read back to the host.

        logits [B, V] (last position of each sequence), one SamplingRow per row. The rows of
        requests with penalties, a logit bias or min_tokens are overwritten in place with their
        processed logits (when ``logits`` is float32). ``constrain`` then masks, in place, the
        float32 logits of the rows with an output constraint (structured outputs: -inf where
        the grammar forbids the token). Greedy rows take the argmax of the processed (and
        masked) logits; log-probabilities are the log-softmax of the same logits.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [B, V] with B = len(rows) = {len(rows)}, got {tuple(logits.shape)}"
            )
        if logits.dtype != torch.float32:
            logits = logits.float()
        if any(row.params.processes_logits for row in rows):
            process_logits_(logits, rows)
        if constrain is not None:
            constrain(logits)
        tokens = logits.argmax(dim=-1)  # [B]; the whole answer when every row is greedy
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if sampled:
            index = host_values(sampled, torch.long, logits.device)  # [S]
            tokens[index] = self._draw(logits, index, [rows[i] for i in sampled])
        record_tokens(rows, tokens)
        return SampledBatch(tokens, compute_logprobs(logits, tokens, rows))

    def _draw(
        self, logits: torch.Tensor, index: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> torch.Tensor:
        """Rows ``index`` of logits [B, V] -> their sampled token ids [S]."""
        num_rows, vocab = len(rows), logits.shape[1]
        device = logits.device
        params = [row.params for row in rows]
        temperature = host_values([q.temperature for q in params], torch.float32, device)  # [S]
        top_k = host_values([q.top_k for q in params], torch.long, device)  # [S]
        top_p = host_values([q.top_p for q in params], torch.float32, device)  # [S]

        weights, mask = self._scratch(num_rows, vocab, device)  # [S, V], [S, V]
        # (index_select with ``out=`` a view of a larger buffer takes a slow path: select first)
        selected = logits if num_rows == logits.shape[0] else logits.index_select(0, index)
        torch.div(selected, temperature[:, None], out=weights)
        filter_weights_(weights, top_k, top_p, self.nucleus_guess, mask_out=mask)
        return inverse_cdf(weights, host_values(_uniforms(rows), torch.float64, device))

    def _scratch(
        self, num_rows: int, vocab: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[S, V] float32 and bool views of buffers that only ever grow."""
        size = num_rows * vocab
        if self._weights.numel() < size or self._weights.device != device:
            self._weights = torch.empty(size, device=device)
            self._mask = torch.empty(size, dtype=torch.bool, device=device)
        return self._weights[:size].view(num_rows, vocab), self._mask[:size].view(num_rows, vocab)


def _uniforms(rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row: seeded rows from their own generator."""
    u = torch.rand(len(rows), dtype=torch.float64)  # [S] global generator
    for i, row in enumerate(rows):
        if row.generator is not None:
            u[i] = torch.rand((), dtype=torch.float64, generator=row.generator)
    return u
