"""int8-dynamic's input rotation (model/rotation.py): orthogonal, the dense ``Q_a ⊗ H_b`` it
states, a product it leaves unchanged, and what it is for: an outlier channel no longer sets
every token's int8 step."""

from __future__ import annotations

import pytest
import torch

from lorastream.worker.model.rotation import Rotation, rotation

CPU = torch.device("cpu")


@pytest.mark.parametrize(("k", "a", "b"), [
    (576, 9, 64),  # SmolLM2's hidden size
    (1536, 12, 128),  # its MLP
    (640, 5, 128),  # Gemma 3 270M's hidden size
    (64, 1, 64),  # a power of two: the Hadamard factor alone
    (7, 7, 1),  # odd: the random orthogonal factor alone
])
def test_the_rotation_is_the_orthogonal_kronecker_product_it_states(
    k: int, a: int, b: int,
) -> None:
    r = Rotation(k, CPU)
    assert (r.a, r.b) == (a, b)
    dense = r.rotate(torch.eye(k))  # [K, K]: row i is e_i R
    torch.testing.assert_close(dense @ dense.T, torch.eye(k), atol=1e-5, rtol=0)
    h = torch.ones(1, 1)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    kron = torch.kron(r._q, h / b**0.5)  # Q_a ⊗ H_b
    torch.testing.assert_close(dense, kron, atol=1e-5, rtol=0)
    x = torch.randn(5, k)
    torch.testing.assert_close(r.undo(r.rotate(x)), x, atol=1e-5, rtol=0)
    torch.testing.assert_close(r.undo(x), x @ dense.T, atol=1e-5, rtol=0)
    w = torch.randn(3, k)
    torch.testing.assert_close(r.rotate(x) @ r.rotate(w).T, x @ w.T, atol=1e-4, rtol=1e-5)


def test_the_rotation_is_the_same_each_time_and_one_per_size() -> None:
    """The weight is rotated at load and each input per call: both must be the one R."""
    assert rotation(576, CPU) is rotation(576, CPU)
    torch.testing.assert_close(Rotation(576, CPU).rotate(torch.eye(576)),
                               rotation(576, CPU).rotate(torch.eye(576)), atol=0, rtol=0)
    assert not torch.allclose(rotation(576, CPU).rotate(torch.eye(576))[:, :64],
                              torch.eye(576)[:, :64], atol=0.5)  # it mixes: not near identity


def test_an_outlier_channel_no_longer_sets_the_tokens_int8_step() -> None:
    """A token with one channel 50x the rest: rounded per token to int8, the plain input loses
    the other channels to a few levels; rotated first, its rounding error is ~10x smaller."""
    torch.manual_seed(0)
    x = torch.randn(16, 1536)
    x[:, 7] *= 50  # [T, K] an outlier channel, as SwiGLU products have

    def int8_error(v: torch.Tensor) -> float:
        step = v.abs().amax(dim=1, keepdim=True) / 127  # [T, 1]
        return float(((v / step).round() * step - v).norm() / v.norm())

    r = rotation(1536, CPU)
    plain, rotated = int8_error(x), int8_error(r.rotate(x))  # R orthogonal: norms compare
    assert rotated * 8 < plain, (plain, rotated)


@pytest.mark.parametrize("k", [576, 1536, 640, 64, 24, 7, 12])  # b 64, 128, 128, 64, 8, 1, 4
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_the_cpu_op_rotates_as_the_torch_path_does(k: int, rows: int) -> None:
    """``lorastream/kernels/cpu/rotation.py``'s fast Walsh-Hadamard op against the two products,
    both ways (b < 8 and b = 1 take the op's scalar path)."""
    from lorastream.kernels.cpu import ops as cpu_ops

    assert cpu_ops.load() is None, cpu_ops.load()  # the machines here build them
    torch.manual_seed(k)
    r, x = Rotation(k, CPU), torch.randn(rows, k) * 3
    torch.testing.assert_close(r.rotate(x, native=True), r.rotate(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r.undo(x, native=True), r.undo(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [576, 1536, 7, 12])  # AVX2 lanes and the scalar tail
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_the_cpu_op_scales_the_rotated_rows_as_the_torch_ops_do(k: int, rows: int) -> None:
    """``rotate_scale_rows``: over its rotated rows, the scaling and the steps are the torch
    ops' bit for bit (so the rounding to int8 is too); a zero row keeps the 1e-12 floor."""
    from lorastream.kernels.cpu import ops as cpu_ops

    assert cpu_ops.load() is None, cpu_ops.load()
    torch.manual_seed(k + rows)
    r, x = Rotation(k, CPU), torch.randn(rows, k) * 3
    x[-1] = 0.0  # with rows = 1, the only row
    scaled, step = r.rotate_scaled(x, 127, native=True)  # [T, K], [T, 1]
    y = r.rotate(x, native=True)
    amax = y.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)
    assert torch.equal(scaled, y * (127 / amax)) and torch.equal(step, amax / 127)
    largest = scaled.abs().amax(dim=1)[:-1]  # 127 to the product's rounding: rounds to 127
    assert bool(((largest - 127).abs() < 1e-4).all()), largest
    assert torch.equal(scaled[-1], torch.zeros(k))
    assert float(step[-1]) == pytest.approx(1e-12 / 127)
    plain, plain_step = r.rotate_scaled(x, 127)  # torch's path: the same up to the rotation's
    torch.testing.assert_close(scaled, plain, atol=1e-4, rtol=1e-5)  # rounding
    torch.testing.assert_close(step, plain_step)
