"""The LoRA delta of slot-major decode steps on the CPU, in one C++ op per projection group.

The torch backend's slot-major path (``worker/lora/backend.py``) runs, per layer, a shrink
``bmm`` per input, an expand ``bmm`` per projection and an ``addcmul`` of each delta into the
output: 18 ops over 32 tiny per-slot products, with a ``[T, N]`` temporary each. ``lora_rows``
(``csrc/lora_rows.cpp``) does the same arithmetic row by row: it reads each row's A and B once,
where the slot storage holds them, and adds the delta into ``out`` in place. Its shrink runs four
8-lane FMA chains over K; its expand takes eight output channels at a time, their rank-long
products reduced into one vector of eight sums (no horizontal sum per channel).

Semantics (fp32; ``G`` projections share the input ``x`` and one A tensor, ``R`` = the slots'
rank, ``r`` = the rank used, ``<= R``; rows ``t`` in slot order, ``per_slot`` rows per slot)::

    slot(t) = slot_lo + t // per_slot
    h[g, k] = sum_i x[t, i] * a[slot(t), g*R + k, i]                     for k < r
    out[t, cols[g] + n] += scale[t] * sum_{k < r} h[g, k] * bs[g][slot(t), n, k]
    rows with scale[t] == 0 (base-model rows) are left as they are

which is the backend's ``add`` / ``add_group`` on a slot-major step whose batch rows are its
layout (the step builder orders decode rows by slot), summed in another order.
tests/worker/lora/test_lora_backend.py holds the two to each other and to PEFT.
"""

from __future__ import annotations

import torch


def lora_rows(
    x: torch.Tensor,  # [T, K] fp32
    a: torch.Tensor,  # [S, G*R, K] slot storage (one layer's)
    bs: list[torch.Tensor],  # G x [S, N_g, R]
    cols: list[int],  # G first columns in out
    scale: torch.Tensor,  # [T] fp32, the row's adapter scaling (0: base model)
    slot_lo: int,
    per_slot: int,
    rank: int,
    out: torch.Tensor,  # [T, N_total] fp32, updated in place
) -> None:
    """``out += delta`` per the module docstring (``cpu_ops.load()`` first)."""
    torch.ops.lorastream.lora_rows(x, a, bs, cols, scale, slot_lo, per_slot, rank, out)
