"""Triton SGMV kernels (in the interpreter) against the fp32 torch reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lorastream.kernels import (
    SgmvMetadata,
    sgmv_expand,
    sgmv_expand_ref,
    sgmv_expand_slices,
    sgmv_expand_slices_ref,
    sgmv_shrink,
    sgmv_shrink_ref,
)
from tests.kernels.batches import assert_h_close, assert_out_close, make_batch

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BATCH_SIZES = [1, 3, 16, 133]
POPULARITIES = ["distinct", "uniform", "zipf", "skewed"]


@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shrink_matches_reference_for_mixed_ranks(
    dtype: torch.dtype, batch_size: int, popularity: str
) -> None:
    batch = make_batch(batch_size, popularity, dtype)
    h = sgmv_shrink(batch.x, batch.lora_a, batch.token_slots, batch.ranks)
    assert h.dtype == torch.float32
    assert_h_close(h, sgmv_shrink_ref(batch.x, batch.lora_a, batch.token_slots, batch.ranks))


@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_expand_matches_reference_for_mixed_ranks(
    dtype: torch.dtype, batch_size: int, popularity: str
) -> None:
    batch = make_batch(batch_size, popularity, dtype)
    args = (batch.h, batch.lora_b, batch.token_slots, batch.ranks, batch.scalings)
    expected = sgmv_expand_ref(*args, batch.out.clone())
    actual = batch.out.clone()
    returned = sgmv_expand(*args, actual)
    assert returned is actual
    assert_out_close(actual, expected)


@pytest.mark.parametrize(
    ("batch_size", "popularity", "no_adapter_every"),
    [
        (1, "distinct", 1),  # the only token has no adapter
        (16, "uniform", 1),  # no token has an adapter
        (16, "uniform", 3),
        (133, "zipf", 2),
    ],
)
def test_rows_without_adapter_get_zero_h_and_keep_their_output(
    batch_size: int, popularity: str, no_adapter_every: int
) -> None:
    batch = make_batch(batch_size, popularity, torch.float16, no_adapter_every=no_adapter_every)
    no_adapter = batch.token_slots == -1
    h = sgmv_shrink(batch.x, batch.lora_a, batch.token_slots, batch.ranks)
    out = sgmv_expand(
        batch.h, batch.lora_b, batch.token_slots, batch.ranks, batch.scalings, batch.out.clone()
    )
    assert torch.equal(h[no_adapter], torch.zeros_like(h[no_adapter]))
    assert torch.equal(out[no_adapter], batch.out[no_adapter])
    assert_h_close(h, sgmv_shrink_ref(batch.x, batch.lora_a, batch.token_slots, batch.ranks))


@pytest.mark.parametrize("device_built_meta", [False, True], ids=["host_meta", "device_meta"])
def test_slots_with_rank_zero_contribute_nothing(device_built_meta: bool) -> None:
    batch = make_batch(16, "distinct", torch.float32)
    ranks = batch.ranks.clone()
    ranks[::2] = 0
    meta = (
        SgmvMetadata.from_device_slots(batch.token_slots, ranks.numel(), max_rank=64)
        if device_built_meta
        else None
    )
    rank_zero = ranks[batch.token_slots.long()] == 0
    h = sgmv_shrink(batch.x, batch.lora_a, batch.token_slots, ranks, meta)
    tables = (batch.token_slots, ranks, batch.scalings)
    out = sgmv_expand(h, batch.lora_b, *tables, batch.out.clone(), meta=meta)
    assert rank_zero.any() and not rank_zero.all()
    assert torch.equal(h[rank_zero], torch.zeros_like(h[rank_zero]))
    assert torch.equal(out[rank_zero], batch.out[rank_zero])
    h_ref = sgmv_shrink_ref(batch.x, batch.lora_a, batch.token_slots, ranks)
    assert_h_close(h, h_ref)
    assert_out_close(out, sgmv_expand_ref(h_ref, batch.lora_b, *tables, batch.out.clone()))


def test_long_segment_spans_several_row_tiles() -> None:
    batch = make_batch(133, "identical", torch.bfloat16)
    h = sgmv_shrink(batch.x, batch.lora_a, batch.token_slots, batch.ranks)
    assert_h_close(h, sgmv_shrink_ref(batch.x, batch.lora_a, batch.token_slots, batch.ranks))
    args = (batch.h, batch.lora_b, batch.token_slots, batch.ranks, batch.scalings)
    expected = sgmv_expand_ref(*args, batch.out.clone())
    assert_out_close(sgmv_expand(*args, batch.out.clone()), expected)


def _host_meta(slots: torch.Tensor, ranks: torch.Tensor) -> SgmvMetadata:
    return SgmvMetadata.from_slots(slots, ranks, "cpu")


def _staged_meta(slots: torch.Tensor, ranks: torch.Tensor) -> SgmvMetadata:
    device = torch.device("cpu")
    staging = SgmvMetadata.allocate_staging(256, ranks.numel(), device)
    device_buffer = SgmvMetadata.allocate_device_buffer(256, ranks.numel(), device)
    return SgmvMetadata.from_slots(slots, ranks, device, staging, device_buffer)


def _device_meta(slots: torch.Tensor, ranks: torch.Tensor) -> SgmvMetadata:
    return SgmvMetadata.from_device_slots(slots, ranks.numel(), max_rank=64)


@pytest.mark.parametrize(
    "build_meta", [_host_meta, _staged_meta, _device_meta], ids=["host", "staged", "device"]
)
@pytest.mark.parametrize(("batch_size", "popularity"), [(3, "distinct"), (133, "skewed")])
def test_precomputed_metadata_gives_the_same_result_as_meta_none(
    build_meta: Callable[[torch.Tensor, torch.Tensor], SgmvMetadata],
    batch_size: int,
    popularity: str,
) -> None:
    batch = make_batch(batch_size, popularity, torch.float16, no_adapter_every=5)
    meta = build_meta(batch.token_slots, batch.ranks)
    h_none = sgmv_shrink(batch.x, batch.lora_a, batch.token_slots, batch.ranks)
    h_meta = sgmv_shrink(batch.x, batch.lora_a, batch.token_slots, batch.ranks, meta=meta)
    args = (batch.h, batch.lora_b, batch.token_slots, batch.ranks, batch.scalings)
    out_none = sgmv_expand(*args, batch.out.clone())
    out_meta = sgmv_expand(*args, batch.out.clone(), meta=meta)
    torch.testing.assert_close(h_meta, h_none, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_meta, out_none, rtol=0, atol=0)


def test_one_metadata_serves_every_layer_of_a_step() -> None:
    # Two layers of different widths (an attention and an MLP projection) share one step's meta.
    layers = [
        make_batch(16, "zipf", torch.bfloat16, hidden=64, out_features=48, weight_seed=0),
        make_batch(16, "zipf", torch.bfloat16, hidden=100, out_features=160, weight_seed=1),
    ]
    meta = SgmvMetadata.from_slots(layers[0].token_slots, layers[0].ranks, "cpu")
    for layer in layers:
        assert torch.equal(layer.token_slots, layers[0].token_slots)
        h = sgmv_shrink(layer.x, layer.lora_a, layer.token_slots, layer.ranks, meta=meta)
        h_ref = sgmv_shrink_ref(layer.x, layer.lora_a, layer.token_slots, layer.ranks)
        assert_h_close(h, h_ref)
        out = sgmv_expand(
            h, layer.lora_b, layer.token_slots, layer.ranks, layer.scalings, layer.out.clone(),
            meta=meta,
        )  # fmt: skip
        out_ref = sgmv_expand_ref(
            h_ref, layer.lora_b, layer.token_slots, layer.ranks, layer.scalings, layer.out.clone()
        )
        assert_out_close(out, out_ref)


@pytest.mark.parametrize(
    ("slice_widths", "batch_size"),
    [
        ((64, 16, 16), 16),  # q / k / v under GQA: 4 query heads, 1 KV head, head_dim 16
        ((64, 16, 16), 133),
        ((80, 80), 3),  # gate / up
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unequal_slices_land_in_their_own_columns(
    slice_widths: tuple[int, ...], batch_size: int, dtype: torch.dtype
) -> None:
    slices = [
        make_batch(batch_size, "uniform", dtype, out_features=width, weight_seed=i)
        for i, width in enumerate(slice_widths)
    ]
    first = slices[0]
    tables = (first.token_slots, first.ranks, first.scalings)
    meta = SgmvMetadata.from_slots(first.token_slots, first.ranks, "cpu")
    h_slices = [sgmv_shrink(s.x, s.lora_a, first.token_slots, first.ranks, meta) for s in slices]
    lora_b_slices = [s.lora_b for s in slices]
    out = torch.randn(batch_size, sum(slice_widths)).to(dtype)

    fused = sgmv_expand_slices(h_slices, lora_b_slices, *tables, out.clone(), meta=meta)
    expected = sgmv_expand_slices_ref(h_slices, lora_b_slices, *tables, out.clone())
    assert_out_close(fused, expected)

    one_by_one = out.clone()
    offset = 0
    for h, lora_b in zip(h_slices, lora_b_slices, strict=True):
        sgmv_expand(h, lora_b, *tables, one_by_one, slice_offset=offset, meta=meta)
        offset += lora_b.shape[1]
    torch.testing.assert_close(one_by_one, fused, rtol=0, atol=0)


def test_expand_slice_leaves_other_columns_untouched() -> None:
    batch = make_batch(16, "skewed", torch.float32, out_features=16)
    out = torch.randn(16, 80)
    updated = sgmv_expand(
        batch.h, batch.lora_b, batch.token_slots, batch.ranks, batch.scalings, out.clone(),
        slice_offset=32,
    )  # fmt: skip
    assert torch.equal(updated[:, :32], out[:, :32])
    assert torch.equal(updated[:, 48:], out[:, 48:])


@pytest.mark.slow
@pytest.mark.parametrize("popularity", ["distinct", "uniform", "zipf", "skewed", "identical"])
@pytest.mark.parametrize("batch_size", [64, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_larger_shapes_match_reference(
    dtype: torch.dtype, batch_size: int, popularity: str
) -> None:
    batch = make_batch(
        batch_size, popularity, dtype, hidden=513, out_features=320,
        rank_cycle=(8, 16, 32, 64, 128),
    )  # fmt: skip
    meta = SgmvMetadata.from_slots(batch.token_slots, batch.ranks, "cpu")
    h = sgmv_shrink(batch.x, batch.lora_a, batch.token_slots, batch.ranks, meta)
    h_ref = sgmv_shrink_ref(batch.x, batch.lora_a, batch.token_slots, batch.ranks)
    assert_h_close(h, h_ref)
    tables = (batch.token_slots, batch.ranks, batch.scalings)
    out = sgmv_expand(h, batch.lora_b, *tables, batch.out.clone(), meta=meta)
    assert_out_close(out, sgmv_expand_ref(h_ref, batch.lora_b, *tables, batch.out.clone()))
