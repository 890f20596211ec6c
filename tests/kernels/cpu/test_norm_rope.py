"""``lorastream/kernels/cpu/norm_rope.py``: the C++ RMSNorm and rotary embedding against torch's
paths in ``worker/model`` (the rotary bit for bit, the norm within an ulp or two of its mean)."""

from __future__ import annotations

import pytest
import torch

from lorastream.kernels.cpu import ops as cpu_ops
from lorastream.kernels.cpu.norm_rope import rms_norm, rotary
from lorastream.worker.model.decoder import RMSNorm
from lorastream.worker.model.rope import apply_rotary


@pytest.fixture(autouse=True)
def _ops() -> None:
    assert cpu_ops.load() is None, cpu_ops.load()  # the machines here build them


# head sizes: AVX2 lanes only (64, 128), a scalar tail (20: half 10); partial rotary (d < D);
# rows: one decode row, a few, a prefill chunk; q and k as the strided views of a fused qkv
@pytest.mark.parametrize(("dim", "d"), [(64, 64), (128, 128), (20, 20), (64, 32), (96, 40)])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_rotary_is_torchs_path_bit_for_bit(dim: int, d: int, rows: int) -> None:
    torch.manual_seed(dim * 100 + d + rows)
    heads, kv_heads = 3, 1
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim) * 3  # [T, (H + 2 Hkv) D]
    q = qkv[:, : heads * dim].view(rows, heads, dim)  # row stride (H + 2 Hkv) D, not H D
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    cos, sin = torch.randn(rows, d), torch.randn(rows, d)
    want_q, want_k = apply_rotary(q, k, cos, sin)
    got_q, got_k = rotary(q, k, cos, sin)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    native_q, native_k = apply_rotary(q, k, cos, sin, native=True)  # the model's switch
    assert torch.equal(native_q, want_q) and torch.equal(native_k, want_k)


@pytest.mark.parametrize("d", [576, 50, 7])  # AVX2 lanes, a tail, fewer than one vector
@pytest.mark.parametrize("rows", [0, 1, 33])
@pytest.mark.parametrize("plus_one", [False, True], ids=["llama", "gemma"])
def test_rms_norm_is_torchs_path_up_to_the_sum_of_squares(d: int, rows: int, plus_one: bool
                                                          ) -> None:
    torch.manual_seed(d + rows)
    x = torch.randn(rows, d) * torch.logspace(-2, 2, d)  # uneven channels, as hidden states
    weight = torch.randn(d)
    torch_norm = RMSNorm(weight, 1e-6, plus_one)
    native_norm = RMSNorm(weight, 1e-6, plus_one, native=True)
    want, got = torch_norm(x), native_norm(x)
    assert got.shape == (rows, d) and got.dtype == torch.float32
    # the mean of squares in fp64 (torch: fp32 in its own order), then the same three roundings
    torch.testing.assert_close(got, want, rtol=4e-7, atol=0.0)
    # exact against the formula with the mean rounded once (rsqrt: as the model's path)
    ref = torch.rsqrt((x.double() ** 2).mean(-1, keepdim=True).float() + 1e-6)  # [T, 1]
    assert torch.equal(got, (x * ref) * torch_norm.weight)


def test_the_ops_refuse_shapes_they_cannot_read() -> None:
    with pytest.raises(RuntimeError, match="x is \\[T, D\\] contiguous"):
        rms_norm(torch.randn(2, 3, 4), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="weight is \\[D\\]"):
        rms_norm(torch.randn(2, 4), torch.ones(5), 1e-6)
    q, k = torch.randn(2, 3, 8), torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="even and at most D"):
        rotary(q, k, torch.randn(2, 10), torch.randn(2, 10))
    with pytest.raises(RuntimeError, match="unit stride in D"):
        rotary(q.transpose(1, 2), k, torch.randn(2, 8), torch.randn(2, 8))


def test_norms_of_other_shapes_and_dtypes_keep_torchs_path() -> None:
    """q/k norms run over [T, H, D] views, bf16 models in bf16: torch's path, unchanged."""
    weight = torch.randn(16)
    x3 = torch.randn(4, 2, 16)
    assert torch.equal(RMSNorm(weight, 1e-6, False, native=True)(x3),
                       RMSNorm(weight, 1e-6, False)(x3))
    bf = RMSNorm(weight.bfloat16(), 1e-6, False, native=True)
    assert not bf.native
    xb = torch.randn(4, 16).bfloat16()
    assert torch.equal(bf(xb), RMSNorm(weight.bfloat16(), 1e-6, False)(xb))
