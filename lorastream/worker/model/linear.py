"""``y = x @ Wᵀ`` for the base model's projections, with the weight prepared once at load.

On CPU with fp32 weights the product runs through oneDNN on a weight reordered once into its
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what torch.compile's CPU backend
does for linear layers): a plain ``x @ w.T`` makes the BLAS pack the whole weight on every call,
which at decode batch sizes costs as much as the multiply itself (the default model's lm_head:
~33 ms packed per call vs ~10 ms prepacked at 32 rows). Elsewhere (CUDA, half precision, a
torch without oneDNN) it is ``x @ w.T``. Results agree with ``x @ w.T`` to fp32 rounding.
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

    @property
    def prepacked(self) -> bool:
        return self._packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self._packed is None:
            assert self.weight is not None
            if self.bias is not None:
                return F.linear(x, self.weight, self.bias)
            return x @ self.weight.T
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
