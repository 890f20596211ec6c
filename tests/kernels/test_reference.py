"""The torch reference against a per-token loop that reads like the documented semantics."""

from __future__ import annotations

import pytest
import torch

from lorastream.kernels import sgmv_expand_ref, sgmv_shrink_ref
from tests.kernels.batches import make_batch


def _shrink_loop(
    x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, ranks: torch.Tensor
) -> torch.Tensor:
    h = torch.zeros(x.shape[0], lora_a.shape[1])
    for t, s in enumerate(token_slots.tolist()):
        if s != -1:
            r = int(ranks[s])
            h[t, :r] = x[t].float() @ lora_a[s, :r].float().T
    return h


def _expand_loop(
    h: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    out: torch.Tensor,
    offset: int,
) -> torch.Tensor:
    n = lora_b.shape[1]
    for t, s in enumerate(token_slots.tolist()):
        if s != -1:
            r = int(ranks[s])
            delta = scalings[s] * (h[t, :r] @ lora_b[s, :, :r].float().T)
            columns = slice(offset, offset + n)
            out[t, columns] = (out[t, columns].float() + delta).to(out.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch_size", "popularity"), [(1, "distinct"), (16, "zipf")])
def test_reference_matches_the_per_token_semantics(
    dtype: torch.dtype, batch_size: int, popularity: str
) -> None:
    batch = make_batch(batch_size, popularity, dtype, no_adapter_every=4)
    h = sgmv_shrink_ref(batch.x, batch.lora_a, batch.token_slots, batch.ranks)
    expected_h = _shrink_loop(batch.x, batch.lora_a, batch.token_slots, batch.ranks)
    torch.testing.assert_close(h, expected_h, rtol=1e-5, atol=1e-5)

    tables = (batch.token_slots, batch.ranks, batch.scalings)
    out = torch.randn(batch_size, batch.lora_b.shape[1] + 8).to(dtype)
    actual = sgmv_expand_ref(batch.h, batch.lora_b, *tables, out.clone(), slice_offset=8)
    expected = _expand_loop(batch.h, batch.lora_b, *tables, out.clone(), offset=8)
    torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-2)
    assert not actual.isnan().any()
