"""Adapter popularity: segment lengths and slot assignment used by tests and the benchmark."""

from __future__ import annotations

import pytest
import torch

from lorastream.kernels.workloads import POPULARITIES, segment_lengths, token_slots_for


@pytest.mark.parametrize(
    ("popularity", "expected"),
    [
        ("distinct", [1] * 16),
        ("uniform", [4, 4, 4, 4]),
        ("zipf", [5, 4, 3, 2, 1, 1]),
        ("skewed", [15, 1]),
        ("identical", [16]),
    ],
)
def test_segment_lengths_match_the_documented_examples(
    popularity: str, expected: list[int]
) -> None:
    assert segment_lengths(16, popularity) == expected


@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("batch_size", [1, 2, 3, 16, 133, 256])
def test_segment_lengths_cover_the_batch_exactly(batch_size: int, popularity: str) -> None:
    lengths = segment_lengths(batch_size, popularity)
    assert sum(lengths) == batch_size
    assert min(lengths) >= 1


def test_unknown_popularity_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown popularity 'hot'"):
        segment_lengths(4, "hot")


def test_token_slots_give_each_adapter_its_own_slot() -> None:
    lengths = [5, 3, 1]
    slots = token_slots_for(lengths, num_slots=8, generator=torch.Generator().manual_seed(0))
    assert slots.dtype == torch.int32
    counts = sorted(torch.bincount(slots.long(), minlength=8).tolist(), reverse=True)
    assert counts[:4] == [5, 3, 1, 0]
