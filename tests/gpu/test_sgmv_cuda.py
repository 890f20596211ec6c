"""The Triton SGMV kernels compiled for the GPU against the fp32 torch reference, over dtype x
rank x batch size x adapter popularity (tests/kernels/ runs the same kernels in the interpreter,
with the same batches and per-dtype tolerances: tests/kernels/batches.py)."""

from __future__ import annotations

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
from tests.kernels.batches import LoraBatch, assert_h_close, assert_out_close, make_batch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
RANKS = [(8,), (16,), (64,), (128,), (4, 8, 16, 64)]  # one rank for all slots, or mixed
BATCH_SIZES = [1, 3, 16, 133, 512]
POPULARITIES = ["distinct", "uniform", "zipf", "skewed", "identical"]


@pytest.fixture(autouse=True)
def compiled_kernels() -> None:
    """These tests check the kernels compiled for the GPU, never the interpreter."""
    from lorastream.kernels import _sgmv_triton

    if _sgmv_triton.is_interpreted():
        pytest.skip("Triton runs in its interpreter (TRITON_INTERPRET=1, set by tests/conftest.py "
                    "for CPU-only machines): run `make test-gpu`, which sets TRITON_INTERPRET=0")


def _to(batch: LoraBatch, device: torch.device) -> LoraBatch:
    return LoraBatch(**{k: v.to(device) for k, v in vars(batch).items()})


def _rank_id(ranks: tuple[int, ...]) -> str:
    return "r" + "-".join(map(str, ranks))


@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("ranks", RANKS, ids=_rank_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shrink_then_expand_on_the_gpu_match_the_reference(
    dtype: torch.dtype, ranks: tuple[int, ...], batch_size: int, popularity: str,
    cuda: torch.device,
) -> None:
    host = make_batch(batch_size, popularity, dtype, hidden=513, out_features=320,
                      rank_cycle=ranks, no_adapter_every=7)
    gpu = _to(host, cuda)
    meta = SgmvMetadata.from_device_slots(gpu.token_slots, gpu.ranks.numel(), max(ranks))
    h = sgmv_shrink(gpu.x, gpu.lora_a, gpu.token_slots, gpu.ranks, meta)
    assert h.device == cuda and h.dtype == torch.float32
    h_ref = sgmv_shrink_ref(host.x, host.lora_a, host.token_slots, host.ranks)
    assert_h_close(h.cpu(), h_ref)
    tables = (gpu.token_slots, gpu.ranks, gpu.scalings)
    out = sgmv_expand(gpu.h, gpu.lora_b, *tables, gpu.out.clone(), meta=meta)
    expected = sgmv_expand_ref(host.h, host.lora_b, host.token_slots, host.ranks, host.scalings,
                               host.out.clone())
    assert_out_close(out.cpu(), expected)


@pytest.mark.parametrize("build", ["host", "staged", "device"])
def test_every_way_of_building_the_metadata_gives_the_same_result(
    build: str, cuda: torch.device
) -> None:
    gpu = _to(make_batch(133, "zipf", torch.bfloat16, no_adapter_every=5), cuda)
    if build == "host":
        meta = SgmvMetadata.from_slots(gpu.token_slots.cpu(), gpu.ranks.cpu(), cuda)
    elif build == "staged":
        staging = SgmvMetadata.allocate_staging(256, gpu.ranks.numel(), cuda)
        device_buffer = SgmvMetadata.allocate_device_buffer(256, gpu.ranks.numel(), cuda)
        meta = SgmvMetadata.from_slots(gpu.token_slots.cpu(), gpu.ranks.cpu(), cuda, staging,
                                       device_buffer)
    else:
        meta = SgmvMetadata.from_device_slots(gpu.token_slots, gpu.ranks.numel(), max_rank=64)
    args = (gpu.h, gpu.lora_b, gpu.token_slots, gpu.ranks, gpu.scalings)
    torch.testing.assert_close(sgmv_expand(*args, gpu.out.clone(), meta=meta),
                               sgmv_expand(*args, gpu.out.clone()), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("popularity", ["distinct", "skewed"])
def test_fused_slices_land_in_their_own_columns(
    dtype: torch.dtype, popularity: str, cuda: torch.device
) -> None:
    widths = (64, 16, 16)  # q / k / v under GQA
    hosts = [make_batch(133, popularity, dtype, out_features=w, weight_seed=i)
             for i, w in enumerate(widths)]
    gpus = [_to(b, cuda) for b in hosts]
    first = gpus[0]
    tables = (first.token_slots, first.ranks, first.scalings)
    meta = SgmvMetadata.from_device_slots(first.token_slots, first.ranks.numel(), max_rank=64)
    h_slices = [sgmv_shrink(g.x, g.lora_a, first.token_slots, first.ranks, meta) for g in gpus]
    out = torch.randn(133, sum(widths)).to(dtype)
    fused = sgmv_expand_slices(h_slices, [g.lora_b for g in gpus], *tables,
                               out.clone().to(cuda), meta=meta)
    host_tables = (hosts[0].token_slots, hosts[0].ranks, hosts[0].scalings)
    expected = sgmv_expand_slices_ref([h.cpu() for h in h_slices], [b.lora_b for b in hosts],
                                      *host_tables, out.clone())
    assert_out_close(fused.cpu(), expected)
