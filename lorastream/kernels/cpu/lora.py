"""The LoRA delta of decode-like steps on the CPU, in one C++ op per projection group: the
slot-major rows of dense projections (``lora_rows``) and a MoE layer's (token, expert)
assignments (``expert_lora_rows``).

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

``expert_lora_rows`` is ``lorastream/worker/lora/experts.py``'s expert delta for decode-like
steps (few assignments per (slot, expert)): where the grouped path sorts the assignments by
``slot * E + expert`` and runs ``grouped_mm`` over all S * E segments (most of them empty at
decode), it takes each assignment as it comes, reads its (slot, expert) A and B from the expert
storage and adds the delta in place. Semantics (fp32; ``P`` assignments of ``T`` tokens, ``G``
projections sharing the input and one A, ``R`` the storage rank, ``r <= R`` the rank used)::

    s = row_slot[token[p]], e = expert[p]          s outside 0..S-1 (no expert adapter): skip
    h[g, k] = sum_i x[p, i] * a[s, e, g*R + k, i]                        for k < r
    out[p, cols[g] + n] += row_scale[token[p]] * sum_{k < r} h[g, k] * bs[g][s, e, n, k]

tests/worker/lora/test_experts.py holds it to the grouped path and to PEFT's merged weights.
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


def expert_lora_rows(
    x: torch.Tensor,  # [P, K] fp32: the assignments' inputs
    token: torch.Tensor,  # [P] int64: each assignment's batch row
    expert: torch.Tensor,  # [P] int64: each assignment's expert
    row_slot: torch.Tensor,  # [T] int64: each batch row's slot (S or -1: no expert adapter)
    row_scale: torch.Tensor,  # [T] fp32: each batch row's scaling
    a: torch.Tensor,  # [S, E, G*R, K] expert storage (one layer's)
    bs: list[torch.Tensor],  # G x [S, E, N_g, R]
    cols: list[int],  # G first columns in out
    rank: int,
    out: torch.Tensor,  # [P, N_total] fp32, updated in place
) -> None:
    """``out += delta`` per assignment (module docstring; ``cpu_ops.load()`` first)."""
    torch.ops.lorastream.expert_lora_rows(x, token, expert, row_slot, row_scale, a, bs, cols,
                                          rank, out)
