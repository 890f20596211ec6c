"""The batched sampler of the decode step (``SamplingParams`` itself is in lorastream.core.generation).

The sampler turns the last-position logits of every sequence in a batch into one token id each:

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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# SamplingParams is part of the worker's API, shared with its clients: it lives in
# lorastream.core.generation and is re-exported here.
from lorastream.core.generation import GREEDY_TEMPERATURE, SamplingParams

__all__ = [
    "GREEDY_TEMPERATURE",
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
    """One row of a sampling batch: the request's parameters and its generator (or None)."""

    params: SamplingParams
    generator: torch.Generator | None = None


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

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """logits [B, V] float32 (last position of each sequence); one SamplingRow per row.

        Returns token ids [B] int64.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [B, V] with B = len(rows) = {len(rows)}, got {tuple(logits.shape)}"
            )
        tokens = logits.argmax(dim=-1)  # [B]; the whole answer when every row is greedy
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not sampled:
            return tokens
        index = torch.tensor(sampled, dtype=torch.long, device=logits.device)  # [S]
        tokens[index] = self._draw(logits.float(), index, [rows[i] for i in sampled])
        return tokens

    def _draw(
        self, logits: torch.Tensor, index: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> torch.Tensor:
        """Rows ``index`` of logits [B, V] -> their sampled token ids [S]."""
        num_rows, vocab = len(rows), logits.shape[1]
        device = logits.device
        params = [row.params for row in rows]
        temperature = torch.tensor([q.temperature for q in params], device=device)  # [S]
        top_k = torch.tensor([q.top_k for q in params], dtype=torch.long, device=device)  # [S]
        top_p = torch.tensor([q.top_p for q in params], device=device)  # [S]

        weights, mask = self._scratch(num_rows, vocab, device)  # [S, V], [S, V]
        # (index_select with ``out=`` a view of a larger buffer takes a slow path: select first)
        selected = logits if num_rows == logits.shape[0] else logits.index_select(0, index)
        torch.div(selected, temperature[:, None], out=weights)
        filter_weights_(weights, top_k, top_p, self.nucleus_guess, mask_out=mask)
        return inverse_cdf(weights, _uniforms(rows).to(device))

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
