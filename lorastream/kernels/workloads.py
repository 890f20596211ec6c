"""Synthetic adapter popularity for kernel tests and benchmarks (after punica's benchmarks).

A popularity turns a batch size into segment lengths, one per adapter in the batch:

    distinct  every token has its own adapter            16 -> [1] * 16
    uniform   ceil(sqrt(B)) adapters, equal shares       16 -> [4, 4, 4, 4]
    zipf      lengths grow by 1.5x per adapter (punica's "zipf:1.5"), largest first
                                                         16 -> [5, 4, 3, 2, 1, 1]
    skewed    one hot adapter takes ~90% of the batch, the rest one token each
                                                         16 -> [15, 1]
    identical one adapter for the whole batch            16 -> [16]
"""

from __future__ import annotations

import math

import torch

POPULARITIES = ("distinct", "uniform", "zipf", "skewed", "identical")

_ZIPF_GROWTH = 1.5
_SKEWED_HOT_SHARE = 0.9


def segment_lengths(batch_size: int, popularity: str) -> list[int]:
    """Tokens per adapter for `batch_size` tokens under `popularity` (sums to `batch_size`)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    if popularity == "distinct":
        return [1] * batch_size
    if popularity == "identical":
        return [batch_size]
    if popularity == "uniform":
        adapters = math.ceil(math.sqrt(batch_size))
        share, extra = divmod(batch_size, adapters)
        return [share + 1] * extra + [share] * (adapters - extra)
    if popularity == "zipf":
        lengths: list[int] = []
        size = 1.0
        while sum(lengths) + math.floor(size) < batch_size:
            lengths.append(math.floor(size))
            size *= _ZIPF_GROWTH
        lengths.append(batch_size - sum(lengths))
        return sorted(lengths, reverse=True)
    if popularity == "skewed":
        hot = max(1, math.ceil(_SKEWED_HOT_SHARE * batch_size))
        return [hot] + [1] * (batch_size - hot)
    raise ValueError(f"unknown popularity {popularity!r}; choose one of {POPULARITIES}")


def token_slots_for(
    lengths: list[int],
    num_slots: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [sum(lengths)] int32
    """Slot per token: adapter i gets a distinct random slot; tokens are shuffled.

    Shuffling makes the batch arrive unsorted, as a scheduler produces it, so the kernels'
    grouping by slot is exercised.
    """
    if len(lengths) > num_slots:
        raise ValueError(f"{len(lengths)} adapters do not fit in {num_slots} slots")
    slots = torch.randperm(num_slots, generator=generator)[: len(lengths)]  # [adapters]
    per_token = torch.repeat_interleave(slots, torch.tensor(lengths))  # [T], grouped
    shuffle = torch.randperm(per_token.numel(), generator=generator)
    return per_token[shuffle].to(torch.int32)
