"""The orthogonal rotation int8-dynamic applies to a projection's input and weight (QuaRot's idea):
a few large channels no longer set every token's int8 step.

Semantics::

    K = a * b: b the largest power of two <= 128 dividing K, a = K / b
    H_b = the Sylvester-Hadamard matrix of order b / sqrt(b)        # [b, b], symmetric, orthogonal
    Q_a = the orthogonal factor of a Gaussian a x a matrix seeded by K, each column's sign that of
          its R factor's diagonal (unique: the same Q on every machine with the same torch);
          1 where a = 1
    R = Q_a ⊗ H_b                                                    # [K, K], orthogonal
    rotate(x) = x @ R          undo(x) = x @ Rᵀ                      # x [..., K]

    x @ Wᵀ = rotate(x) @ rotate(W)ᵀ   for W [N, K], since R Rᵀ = I

int8-dynamic rounds each token's activations to int8 with one step per token, the token's largest
|x| / 127. A channel that runs 10-50x the others (RMSNorm outputs and SwiGLU products have such
channels) then leaves the rest of the token a few int8 levels. After the rotation every output
channel is a mix of all input channels, so the largest is near the typical size and the step
shrinks with it; the weight is quantized rotated, and the product is the same sum. It brings
the mode's greedy tokens much closer to the reference's; how close varies a little with the
random factor ``Q_a`` (measured: docs/notes/quantization.md, "The rotation in
`int8-dynamic`").

Applied as two small products, ``x.view(T, a, b) @ H_b`` and then ``Q_aᵀ`` over the a axis:
K (a + b) multiply-adds per row instead of K²; or, where the C++ CPU ops run (``native``, as
``--cpu-kernels`` decides), as one op with a fast Walsh-Hadamard transform
(``lorastream/kernels/cpu/rotation.py``).
"""

from __future__ import annotations

import functools
import math

import torch

from lorastream.kernels.cpu.rotation import rotate_rows, rotate_scale_rows

_MAX_HADAMARD = 128  # b: the Hadamard factor's largest order


def _hadamard(order: int) -> torch.Tensor:  # [order, order], order a power of two
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < order:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(order)


def _random_orthogonal(order: int, seed: int) -> torch.Tensor:  # [order, order]
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(order, order, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]  # the unique Q with a positive R diagonal


class Rotation:
    """``R = Q_a ⊗ H_b`` for inputs of size K (module docstring), on one device."""

    def __init__(self, k: int, device: torch.device) -> None:
        b = 1
        while k % (2 * b) == 0 and 2 * b <= _MAX_HADAMARD:
            b *= 2
        self.k, self.a, self.b = k, k // b, b
        self._h = _hadamard(b).float().to(device)  # [b, b]
        # [a, a]; a = 1: the identity, whose product _apply skips
        q = _random_orthogonal(self.a, seed=k) if self.a > 1 else torch.ones(1, 1)
        self._qt = q.T.contiguous().float().to(device)  # [a, a] Qᵀ
        self._q = q.contiguous().float().to(device)  # [a, a]

    def _apply(self, x: torch.Tensor, left: torch.Tensor, native: bool
               ) -> torch.Tensor:  # [T, K] -> [T, K]
        if native:
            return rotate_rows(x.contiguous(), left, self.b)
        t = x.shape[0]
        y = x.reshape(t, self.a, self.b) @ self._h  # [T, a, b]
        if self.a > 1:
            y = left @ y  # [a, a] @ [T, a, b] -> [T, a, b]
        return y.reshape(t, self.k)

    def rotate(self, x: torch.Tensor, native: bool = False
               ) -> torch.Tensor:  # [T, K] fp32 -> [T, K] fp32
        """``x @ R`` (``native``: on the C++ op, built and loaded by ``cpu_ops.load()``)."""
        return self._apply(x, self._qt, native)

    def rotate_scaled(self, x: torch.Tensor, qmax: int, native: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, K] -> [T, K], [T, 1]
        """``x @ R`` with each row scaled by ``qmax / max |row|``, and each row's step
        ``max |row| / qmax`` (the max at least 1e-12): int8-dynamic's input, to be rounded.
        ``native``: in the same pass as the rotation (``cpu_rotation.rotate_scale_rows``: its
        scaling is bit for bit these torch ops' over its rotated rows)."""
        if native:
            return rotate_scale_rows(x.contiguous(), self._qt, self.b, float(qmax))
        y = self.rotate(x)  # [T, K]
        amax = y.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)  # [T, 1]
        return y * (qmax / amax), amax / qmax

    def undo(self, x: torch.Tensor, native: bool = False
             ) -> torch.Tensor:  # [T, K] fp32 -> [T, K] fp32
        """``x @ Rᵀ``."""
        return self._apply(x, self._q, native)


@functools.cache
def rotation(k: int, device: torch.device) -> Rotation:
    """The rotation of inputs of size ``k`` on ``device`` (one per size and device)."""
    return Rotation(k, device)
