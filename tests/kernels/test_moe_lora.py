"""The expert-LoRA Triton path (lorastream.kernels.moe_lora, in the interpreter) against the
torch path of ``lora/experts.py``: the same rows, the same deltas, none for rows without."""

from __future__ import annotations

import pytest
import torch

from lorastream.kernels.moe_lora import moe_lora

pytest.importorskip("triton")


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float16, 2e-2)])
@pytest.mark.parametrize("projections", [1, 2], ids=["down", "gate-up"])
def test_moe_lora_adds_each_rows_expert_delta_only(
    dtype: torch.dtype, tol: float, projections: int
) -> None:
    torch.manual_seed(0)
    slots, experts, rank, k, n = 2, 4, 16, 32, 16
    groups_n = slots * experts
    rows = 24
    x = torch.randn(rows, k).to(dtype)  # [P, K]
    groups = torch.randint(-1, groups_n, (rows,), dtype=torch.int32)  # [P]
    a = (torch.randn(groups_n, projections * rank, k) * 0.3).to(dtype)
    bs = [(torch.randn(groups_n, n, rank) * 0.3).to(dtype) for _ in range(projections)]
    scalings = torch.rand(groups_n, dtype=torch.float32) + 0.5
    out = torch.randn(rows, n * projections).to(dtype)
    expected = out.float().clone()
    for p, g in enumerate(groups.tolist()):  # the Semantics, row by row
        if g < 0:
            continue
        h = x[p].float() @ a[g].float().T
        for w, b in enumerate(bs):
            expected[p, w * n : (w + 1) * n] += (
                scalings[g] * h[w * rank : (w + 1) * rank] @ b[g].float().T)
    before = out.clone()
    moe_lora(x, groups, a, bs, scalings, out)
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    untouched = groups < 0
    assert bool(untouched.any()) and torch.equal(out[untouched], before[untouched])
