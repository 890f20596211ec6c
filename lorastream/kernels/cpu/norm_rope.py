"""RMSNorm of hidden states and the rotary embedding of q and k on the CPU, one C++ op each
(``csrc/norm_rope.cpp``).

In torch, RMSNorm (``worker/model/decoder.py``) is six small ops and the rotary embedding
(``worker/model/rope.py``) twelve, for q and k: at decode shapes their launches and passes over
memory, not their arithmetic, take the time, in every layer of every step. Each op here is one
pass (measured: docs/notes/cpu-kernels.md, "Timings moved from the ops' docstrings").

Semantics (fp32)::

    rms_norm(x [T, D], w [D]):
        r[t] = 1 / sqrt(mean_i x[t, i]^2 + eps)       # the mean summed in fp64, rounded once
        out[t, i] = (x[t, i] * r[t]) * w[i]          # -> [T, D]

    rotary(q [T, H, D], k [T, Hkv, D], cos [T, d], sin [T, d]), per head row x:
        out[:d] = x[:d] * cos + rotate_half(x[:d]) * sin   # rotate_half(y) = [-y[d/2:], y[:d/2]]
        out[d:] = x[d:]                                    # partial rotary passes through
        -> (q', k') contiguous

``rotary`` is bit for bit ``rope.apply_rotary`` (two products and a sum, each rounded as torch
rounds them: no fused multiply-add). ``rms_norm`` is ``decoder.RMSNorm`` except for the mean,
which torch sums in fp32 in its own order: within an ulp or two of it (Gemma's ``1 + w`` is
folded into ``w`` by the caller, as RMSNorm stores it). tests/kernels/test_norm_rope.py holds
both to torch's paths.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [T, D]`` fp32, contiguous -> ``[T, D]`` per the module docstring (``cpu_ops.load()``
    first)."""
    return torch.ops.lorastream.rms_norm(x, weight, eps)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, H, D]``, ``k [T, Hkv, D]`` (unit stride in D), ``cos``/``sin [T, d]`` fp32 ->
    the rotated ``(q, k)``, contiguous, per the module docstring."""
    q_out, k_out = torch.ops.lorastream.rotary(q, k, cos, sin)
    return q_out, k_out
