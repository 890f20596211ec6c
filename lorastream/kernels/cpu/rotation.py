"""int8-dynamic's input rotation on the CPU in one C++ op (``csrc/rotate_rows.cpp``).

In torch the rotation (``worker/model/rotation.py``) is two products: ``x.view(T, a, b) @ H_b``
(K·b multiply-adds per row) and the a x a factor across the blocks, broadcast over the rows.
The op runs each block through a fast Walsh-Hadamard transform instead (K·log2(b) additions,
the first three stages inside AVX2 registers) and applies the small factor in the same pass over
the row.

Semantics (fp32; ``K = a * b``, ``b`` a power of two; ``left`` [a, a])::

    H_b = the Sylvester-Hadamard matrix of order b (entries +-1), H_2n = [[H, H], [H, -H]]
    blocks[t, i, :] = x[t, i*b : (i+1)*b] @ H_b / sqrt(b)        for i < a
    out[t, i*b : (i+1)*b] = sum_j left[i, j] * blocks[t, j, :]

which is ``x @ kron(leftᵀ, H_b / sqrt(b))``: ``rotation.Rotation.rotate`` with ``left = Q_aᵀ``,
``undo`` with ``left = Q_a``, summed in another order. tests/worker/model/test_rotation.py holds the
two paths to each other.

``rotate_scale_rows`` is int8-dynamic's whole input step (``quant_linear.QuantLinear``) in the
same pass; over the rotated rows its scaling is bit for bit the torch ops it replaces
(six small ops per projection)::

    y = out as above                                   # [T, K]
    amax[t] = max(max_k |y[t, k]|, 1e-12)               # [T, 1]
    scaled[t, k] = y[t, k] * ((1 / amax[t]) * qmax)     # torch's qmax / amax: reciprocal, times
    step[t] = amax[t] / qmax                            # -> (scaled [T, K], step [T, 1])
"""

from __future__ import annotations

import torch


def rotate_rows(x: torch.Tensor, left: torch.Tensor, b: int) -> torch.Tensor:
    """``x [T, K]`` fp32 -> ``[T, K]`` per the module docstring (``cpu_ops.load()`` first)."""
    return torch.ops.lorastream.rotate_rows(x, left, b)


def rotate_scale_rows(x: torch.Tensor, left: torch.Tensor, b: int, qmax: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` fp32 -> ``(scaled [T, K], step [T, 1])`` per the module docstring."""
    scaled, step = torch.ops.lorastream.rotate_scale_rows(x, left, b, qmax)
    return scaled, step
