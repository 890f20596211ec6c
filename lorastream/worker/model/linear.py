"""``y = x @ Wᵀ`` for the base model's projections, with the weight prepared once at load.

On CPU with fp32 weights the product runs through oneDNN on a weight reordered once into its
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what torch.compile's CPU backend
does for linear layers): a plain ``x @ w.T`` makes the BLAS pack the whole weight on every call,
which at decode batch sizes costs as much as the multiply itself (measured:
docs/notes/cpu-kernels.md, "Timings moved from the ops' docstrings"). Elsewhere (CUDA, half
precision, a torch without oneDNN) it is ``x @ w.T``. Results agree with ``x @ w.T`` to fp32
rounding.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# The rows oneDNN tunes the blocked layout for (a decode batch); any row count works.
_PACK_ROWS_HINT = 32


def _can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear:
    """A projection: ``linear(x)`` = ``x @ weight.T (+ bias)`` for x [T, K] -> [T, N]."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias  # [N] or None
        self._packed: torch.Tensor | None = None
        if prepack and _can_prepack(weight):
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
            except RuntimeError as err:  # an unusual shape or build: the plain product works
                log.debug("no oneDNN prepacking for a %s weight: %s", list(weight.shape), err)
        # [N, K], kept only when the product uses it: a prepacked weight is a full copy, and
        # the original is freed once its owner lets go of it too.
        self.weight: torch.Tensor | None = None if self._packed is not None else weight
        # [N] fp64 ||W_n||², for :meth:`delta_row_norms` once only the packed copy is left
        self._row_sq = (weight.double().pow(2).sum(1) if self._packed is not None else None)

    @property
    def prepacked(self) -> bool:
        return self._packed is not None

    def delta_row_norms(
        self, rows: slice, b: torch.Tensor, a: torch.Tensor
    ) -> torch.Tensor:  # b [n, r], a [r, K] -> [n] fp32
        """``||W[rows] + b @ a||`` per output row (DoRA's weight norm, PEFT's
        ``get_weight_norm``), over the weight the product uses.

        Semantics::

            norm[n] = sqrt(sum_k (W[rows][n, k] + sum_j b[n, j] a[j, k])²)

        With only the prepacked copy held, the square is expanded:
        ``||W_n||² + 2 b_n·(W_n aᵀ) + b_n (a aᵀ) b_nᵀ``, ``W aᵀ`` from the product itself
        (``self(a)`` less the bias: r rows through the projection), the sums in fp64; the
        cost is a prefill of r tokens, not the ``[n, K]`` matrix ``b a``."""
        if self.weight is not None:
            w = self.weight[rows].float()  # [n, K]
            return (w + b.float() @ a.float()).norm(dim=1)
        assert self._row_sq is not None
        wa = self(a).double()[:, rows]  # [r, n] = (W aᵀ)ᵀ (+ bias)
        if self.bias is not None:
            wa = wa - self.bias[rows].double()
        b64, a64 = b.double(), a.double()  # [n, r], [r, K]
        cross = (b64 * wa.T).sum(1)  # [n]
        delta = ((b64 @ (a64 @ a64.T)) * b64).sum(1)  # [n]: ||(b a)_n||²
        return (self._row_sq[rows] + 2 * cross + delta).clamp_min(0).sqrt().float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self._packed is None:
            assert self.weight is not None
            if self.bias is not None:
                return F.linear(x, self.weight, self.bias)
            return x @ self.weight.T
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
