"""A MoE layer's routed experts at decode on the CPU: one C++ op per product.

At decode each expert gets a few of the step's (token, expert) assignments, and torch's
``grouped_mm`` (or one matmul per expert) runs a GEMM of a few rows per expert, which on this
CPU costs far more than reading the expert's weight. ``expert_segments_mm``
(``csrc/moe_experts.cpp``) streams each visited expert's weight once, row by row, from where the
model holds it ([E, N, K], the checkpoint's fused layout), and takes every assignment of that
expert against the row while it is in the cache.

Semantics (fp32; ``x`` rows sorted by expert, ``ends`` [E] the cumulative ends of the experts'
segments, as ``model/moe.py`` builds them)::

    out[p, n] = sum_k x[p, k] * w[e, n, k]      for p in ends[e-1] .. ends[e] - 1

which is ``grouped_mm(x, w.transpose(1, 2), offs=ends)``, summed in another order.
tests/worker/model/test_moe.py holds the block on it to transformers' own.
"""

from __future__ import annotations

import torch


def expert_segments_mm(
    x: torch.Tensor,  # [P, K] fp32: the assignments' inputs, sorted by expert
    w: torch.Tensor,  # [E, N, K] fp32: each expert's weight, unit last stride
    ends: torch.Tensor,  # [E] int64: cumulative segment ends (CPU)
) -> torch.Tensor:  # [P, N]
    """``x`` times each segment's expert weight (module docstring; ``cpu_ops.load()`` first)."""
    out = x.new_empty((x.shape[0], w.shape[1]))
    torch.ops.lorastream.expert_segments_mm(x.contiguous(), w, ends, out)
    return out
