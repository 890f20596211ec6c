"""SgmvMetadata: grouping tokens by slot on the host (and on the device), buffers, errors."""

from __future__ import annotations

import pytest
import torch

from lorastream.kernels import SgmvMetadata

CPU = torch.device("cpu")


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_from_slots_groups_tokens_by_slot_as_documented() -> None:
    meta = SgmvMetadata.from_slots(_int32([2, -1, 0, 2, 0, 2]), _int32([8, 0, 16]), CPU)
    assert meta.token_order.tolist() == [2, 4, 0, 3, 5]
    assert meta.seg_starts.tolist() == [0, 2]
    assert meta.seg_lens.tolist() == [2, 3]
    assert meta.seg_slots.tolist() == [0, 2]
    assert (meta.num_tokens, meta.num_segments, meta.max_seg_len, meta.max_rank) == (6, 2, 3, 16)
    assert all(
        t.dtype == torch.int32
        for t in (meta.token_order, meta.seg_starts, meta.seg_lens, meta.seg_slots)
    )


@pytest.mark.parametrize(
    ("token_slots", "ranks"),
    [
        ([], [16]),  # empty batch
        ([-1, -1], [16]),  # no token has an adapter
        ([1, 1, -1], [16, 0]),  # the only adapter in use has rank 0
        ([-1], []),  # no slots at all
    ],
)
def test_from_slots_launches_nothing_without_adapter_work(
    token_slots: list[int], ranks: list[int]
) -> None:
    meta = SgmvMetadata.from_slots(_int32(token_slots), _int32(ranks), CPU)
    assert (meta.num_tokens, meta.num_segments) == (len(token_slots), 0)
    assert (meta.max_seg_len, meta.max_rank) == (0, 0)


def test_from_slots_fills_fixed_buffers_in_place_step_after_step() -> None:
    staging = SgmvMetadata.allocate_staging(max_tokens=8, num_slots=4, device=CPU)
    device_buffer = SgmvMetadata.allocate_device_buffer(max_tokens=8, num_slots=4, device=CPU)
    ranks = _int32([4, 8, 16, 64])
    steps = [_int32([3, 3, 1, -1, 0]), _int32([2, 0, 2, 2, 1, 3, -1, 0])]
    for token_slots in steps:
        meta = SgmvMetadata.from_slots(token_slots, ranks, CPU, staging, device_buffer)
        plain = SgmvMetadata.from_slots(token_slots, ranks, CPU)
        assert meta.token_order.data_ptr() == device_buffer.data_ptr()
        for name in ("token_order", "seg_starts", "seg_lens", "seg_slots"):
            assert torch.equal(getattr(meta, name), getattr(plain, name)), name
            assert getattr(meta, name).untyped_storage().data_ptr() == device_buffer.data_ptr()
        assert (meta.num_segments, meta.max_seg_len, meta.max_rank) == (
            plain.num_segments, plain.max_seg_len, plain.max_rank,
        )  # fmt: skip


def test_from_device_slots_gives_every_slot_a_segment_without_reading_values() -> None:
    meta = SgmvMetadata.from_device_slots(_int32([2, -1, 0, 2, 0, 2]), num_slots=3, max_rank=64)
    assert meta.token_order.tolist() == [1, 2, 4, 0, 3, 5]  # the no-adapter token sorts first
    assert meta.seg_starts.tolist() == [1, 3, 3]
    assert meta.seg_lens.tolist() == [2, 0, 3]
    assert meta.seg_slots.tolist() == [0, 1, 2]
    # Grid bounds are the worst case, known without looking at the slot values.
    assert (meta.num_tokens, meta.num_segments, meta.max_seg_len, meta.max_rank) == (6, 3, 6, 64)


@pytest.mark.parametrize(
    ("token_slots", "ranks", "message"),
    [
        (torch.tensor([0, 1]), _int32([4, 4]), "token_slots_cpu must be a 1-D int32"),
        (
            torch.tensor([[0, 1]], dtype=torch.int32),
            _int32([4, 4]),
            "token_slots_cpu must be a 1-D int32",
        ),
        (_int32([0, 1]), torch.tensor([4.0, 4.0]), "ranks_cpu must be a 1-D int32"),
        (_int32([0, 2]), _int32([4, 4]), r"values must lie in \[-1, 2\)"),
        (_int32([-2, 0]), _int32([4, 4]), r"values must lie in \[-1, 2\)"),
        (_int32([0, 1]), _int32([4, -1]), "ranks_cpu must be >= 0"),
    ],
)
def test_from_slots_rejects_bad_tables_with_a_clear_message(
    token_slots: torch.Tensor, ranks: torch.Tensor, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SgmvMetadata.from_slots(token_slots, ranks, CPU)


@pytest.mark.parametrize(
    ("staging", "message"),
    [
        (torch.empty(3, dtype=torch.int32), "holds 3 int32 values but this step needs"),
        (torch.empty(64, dtype=torch.int64), "staging must be a contiguous 1-D int32"),
    ],
)
def test_from_slots_rejects_unusable_staging_buffers(staging: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SgmvMetadata.from_slots(_int32([0, 1, 1]), _int32([4, 4]), CPU, staging=staging)


def test_buffer_capacity_covers_the_largest_step() -> None:
    max_tokens, num_slots = 5, 3
    capacity = SgmvMetadata.buffer_capacity(max_tokens, num_slots)
    staging = torch.empty(capacity, dtype=torch.int32)
    # Worst case: every token has an adapter and every slot is used.
    SgmvMetadata.from_slots(_int32([0, 1, 2, 0, 1]), _int32([4, 4, 4]), CPU, staging=staging)
