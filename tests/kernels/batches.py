"""Test batches for the SGMV kernels: slot storage, a batch of tokens, per-dtype tolerances.

Every slot stores NaN beyond its rank, unused slots are NaN throughout, and so is `h` beyond each
token's rank and on rows without an adapter: a kernel that reads a value it should not (instead of
using `ranks` and the slot table) produces NaN and fails the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorastream.kernels.workloads import segment_lengths, token_slots_for

MIXED_RANKS = (4, 8, 16, 64)
ODD_HIDDEN = 73  # 72 + 1: the last K tile is ragged
OUT_FEATURES = 96  # not a multiple of the N tile

# (rtol, atol) for the expand output, per dtype (punica's tests for fp16 / bf16). The
# interpreter truncates fp32 -> bf16 where a GPU rounds to nearest, hence 1 bf16 ulp of slack.
OUT_TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 2e-2),
}
# The shrink output is fp32 and its inputs are exact in fp32, whatever their dtype.
H_TOLERANCE = (1e-4, 1e-4)


@dataclass
class LoraBatch:
    """One step's batch and the slot storage it reads."""

    x: torch.Tensor  # [T, K]
    lora_a: torch.Tensor  # [S, R_max, K]
    lora_b: torch.Tensor  # [S, N, R_max]
    h: torch.Tensor  # [T, R_max] float32 expand input, NaN beyond each token's rank
    out: torch.Tensor  # [T, N] layer output before the LoRA update
    token_slots: torch.Tensor  # [T] int32
    ranks: torch.Tensor  # [S] int32
    scalings: torch.Tensor  # [S] float32


def make_batch(
    batch_size: int,
    popularity: str,
    dtype: torch.dtype,
    hidden: int = ODD_HIDDEN,
    out_features: int = OUT_FEATURES,
    rank_cycle: tuple[int, ...] = MIXED_RANKS,
    no_adapter_every: int = 0,
    seed: int = 0,
    weight_seed: int | None = None,
) -> LoraBatch:
    """A batch whose adapters follow `popularity`; slot i has rank `rank_cycle[i % len]`.

    Slots are drawn at random, so the ranks within a batch are mixed. With `no_adapter_every=n`,
    every n-th token has no adapter (slot -1). `seed` draws the slots; batches with the same
    `seed` and different `weight_seed` share slots and ranks (several layers or slices of a step).
    """
    generator = torch.Generator().manual_seed(seed)
    lengths = segment_lengths(batch_size, popularity)
    num_slots = len(lengths) + 2  # two spare slots that no token uses
    token_slots = token_slots_for(lengths, num_slots, generator)  # [T]
    if no_adapter_every:
        token_slots[::no_adapter_every] = -1
    ranks = torch.tensor(
        [rank_cycle[i % len(rank_cycle)] for i in range(num_slots)], dtype=torch.int32
    )  # [S]
    max_rank = max(rank_cycle)
    if weight_seed is not None:
        generator.manual_seed(1_000_003 * (weight_seed + 1) + seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    lora_a = _nan_beyond_rank(randn(num_slots, max_rank, hidden) * 0.1, ranks, dim=1)
    lora_b = _nan_beyond_rank(randn(num_slots, out_features, max_rank) * 0.1, ranks, dim=2)
    used = torch.zeros(num_slots, dtype=torch.bool)
    used[token_slots[token_slots >= 0].long()] = True
    lora_a[~used] = float("nan")
    lora_b[~used] = float("nan")
    token_ranks = torch.where(token_slots >= 0, ranks[token_slots.clamp(min=0).long()], 0)  # [T]
    h = _nan_beyond_rank(randn(batch_size, max_rank), token_ranks, dim=1)
    return LoraBatch(
        x=randn(batch_size, hidden).to(dtype),
        lora_a=lora_a.to(dtype),
        lora_b=lora_b.to(dtype),
        h=h,
        out=randn(batch_size, out_features).to(dtype),
        token_slots=token_slots,
        ranks=ranks,
        scalings=torch.rand(num_slots, generator=generator) + 0.5,
    )


def assert_out_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = OUT_TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def assert_h_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = H_TOLERANCE
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def _nan_beyond_rank(weights: torch.Tensor, ranks: torch.Tensor, dim: int) -> torch.Tensor:
    """NaN at every index >= the row's rank along `dim`; `ranks` has one entry per row (dim 0)."""
    view = [1] * weights.dim()
    view[dim] = -1
    index = torch.arange(weights.shape[dim]).view(view)
    row_ranks = ranks.view([-1] + [1] * (weights.dim() - 1))
    return weights.masked_fill(index >= row_ranks, float("nan"))
