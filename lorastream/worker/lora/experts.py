"""The LoRA deltas of a mixture-of-experts layer's routed experts, for a mixed batch.

``model/moe.py`` sorts the step's T * k (token, expert) assignments by expert and runs every
expert's gate_up and down products over its rows. This module adds, to those rows, each
adapter's delta *for the expert the row was routed to* only::

    for each assignment p (token t, expert e), slot s of t's adapter (none: nothing added):
        gate_up[p] += scaling_s * (B_gu[s, e] @ (A_gu[s, e] @ x[p]))     gate and up halves
        down_out[p] += scaling_s * (B_d[s, e] @ (A_d[s, e] @ act[p]))

in a few batched ops: the adapted assignments are sorted again by the key ``s * E + e`` (stably),
giving S * E segments, and ``grouped_mm`` runs the shrink and the expand of every (slot,
expert) segment at once; one ``index_add_`` puts the deltas back on the assignments' rows.
Assignments of rows without an expert adapter sort last (key ``S * E + e``) and are left out:
their count is known on the host (k per adapted row), so no step reads a device value back.
Example, S = 2, E = 4, k = 2, rows [t0: slot 1, t1: base, t2: slot 0], experts
[[2, 0], [0, 3], [2, 1]]::

    sorted by expert:  p = (t0,0) (t1,0) (t2,1) (t0,2) (t2,2) (t1,3)
    key s * E + e:          4      8+0     1      6      2      8+3
    adapted, by key:   (t2,1) (t2,2) (t0,0) (t0,2)     ends[0..7] = [0,1,2,2,3,3,4,4]

The gate and up halves read one shrink of ``2 R`` columns (gate's A, then up's: PEFT's fused
form holds one A for both, copied into each half). Cost follows the slots' rank R, not each
adapter's: their rows beyond the rank are zero. The Triton backend runs the Triton kernel
(``kernels/moe_lora.py``, :func:`add_expert_lora_triton`) in place of the grouped GEMMs: the
same sums, each assignment's group ``s * E + e`` (-1 without an expert adapter) read from the
router's choices on the device, and each group's scaling its slot's.

On the CPU with the C++ ops (``--cpu-kernels``), decode-like steps, whose assignments spread
thin over the S * E groups (:func:`few_per_group`), skip the sort and the mostly empty segments:
:func:`add_expert_lora_rows` runs ``expert_lora_rows`` (``kernels/cpu/lora.py``), which takes
the assignments as they come and reads each one's (slot, expert) A and B from the storage, once
per assignment, into its own row. Prefill-heavy steps keep the grouped GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lorastream.kernels.cpu.lora import expert_lora_rows
from lorastream.kernels.moe_lora import moe_lora  # Triton itself: imported at the first launch
from lorastream.worker.device.step_arena import Arena
from lorastream.worker.lora.slots import LoraSlots

ROWS_PER_GROUP = 8  # the row path while the busiest slot's assignments per expert stay below


@dataclass(frozen=True)
class ExpertStepMeta:
    """Per step: each batch row's slot for the expert deltas and its scaling."""

    row_slots: torch.Tensor  # [T] int64: the row's slot, or S (no expert adapter)
    row_scale: torch.Tensor  # [T] float: the slot's scaling, 0 for rows without
    slot_scale: torch.Tensor  # [S] float32: each slot's scaling (the Triton path's groups')
    adapted_rows: int  # rows with an expert adapter (host-known)
    num_slots: int
    max_rank: int = 0  # the largest rank of the step's expert adapters
    max_slot_rows: int = 0  # the most rows one slot has in the step


def build_expert_meta(
    token_slots: list[int], slots: LoraSlots, dtype: torch.dtype, device: torch.device,
    arena: Arena | None = None,
) -> ExpertStepMeta | None:
    """None when no row's adapter adapts the experts (or the base model has none); staged in
    ``arena`` when given (2 T + S entries; the engine flushes it)."""
    if not slots.expert_a:
        return None
    table, none = slots.table, slots.num_slots
    adapted = {s for s in set(token_slots)
               if s >= 0 and any(m.startswith("experts.") for m in table[s].modules)}
    if not adapted:
        return None
    row_slots = [s if s in adapted else none for s in token_slots]
    scale = [table[s].scaling if s in adapted else 0.0 for s in token_slots]
    per_slot = [info.scaling if s in adapted else 0.0 for s, info in enumerate(table)]
    if arena is not None:
        slots_t, scale_t = arena.longs(row_slots), arena.floats(scale)
        slot_scale = arena.floats(per_slot)
    else:
        slots_t, scale_t = torch.tensor(row_slots).to(device), torch.tensor(scale).to(device)
        slot_scale = torch.tensor(per_slot, dtype=torch.float32).to(device)
    return ExpertStepMeta(
        row_slots=slots_t,
        row_scale=scale_t.to(dtype),  # the cast runs on the device after the flush
        slot_scale=slot_scale,
        adapted_rows=sum(s in adapted for s in token_slots),
        num_slots=none,
        max_rank=max(table[s].rank for s in adapted),
        max_slot_rows=max(token_slots.count(s) for s in adapted),
    )


def _grouped_ok(t: torch.Tensor) -> bool:
    size = t.element_size()
    return all(st * size % 16 == 0 for st, n in zip(t.stride(), t.shape, strict=True)
               if st != 1 and n > 1)


def _segment_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [P, K] rows in segments (``ends`` [G] cumulative) times w [G, K, N] -> [P, N]."""
    if _grouped_ok(x) and _grouped_ok(w):
        return F.grouped_mm(x, w, offs=ends.to(torch.int32))
    out = x.new_empty((x.shape[0], w.shape[2]))  # strides grouped_mm cannot take: a loop
    start = 0
    for g, end in enumerate(ends.tolist()):  # host sync: this fallback only
        if end > start:
            out[start:end] = x[start:end] @ w[g]
        start = end
    return out


def add_expert_lora(
    x: torch.Tensor,  # [P, K]: the assignments' inputs, sorted by expert
    token: torch.Tensor,  # [P]: each assignment's batch row
    expert: torch.Tensor,  # [P]: each assignment's expert
    a: torch.Tensor,  # [S, E, G * R, K]: the A of G projections that read x
    bs: list[torch.Tensor],  # G x [S, E, N_g, R]
    out: torch.Tensor,  # [P, sum N_g]: the projections' outputs, side by side
    top_k: int,
    meta: ExpertStepMeta,
) -> None:
    """out[p] += scaling * (B[s, e] @ (A[s, e] @ x[p])) per assignment (module docstring)."""
    num_slots, num_experts, width, k = a.shape
    groups = num_slots * num_experts
    rank = width // len(bs)
    slot = meta.row_slots.index_select(0, token)  # [P]
    key = slot * num_experts + expert  # [P]: S * E + e for rows without an expert adapter
    order = torch.argsort(key, stable=True)[: meta.adapted_rows * top_k]  # [Pa]
    ends = torch.bincount(key, minlength=groups + num_experts)[:groups].cumsum(0)  # [S * E]
    xs = x.index_select(0, order)  # [Pa, K]
    h = _segment_mm(xs, a.reshape(groups, width, k).transpose(1, 2), ends)  # [Pa, G * R]
    h = h * meta.row_scale.index_select(0, token.index_select(0, order)).unsqueeze(1)
    ys = [
        _segment_mm(h[:, g * rank : (g + 1) * rank],
                    b.reshape(groups, b.shape[2], rank).transpose(1, 2), ends)  # [Pa, N_g]
        for g, b in enumerate(bs)
    ]
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)  # [Pa, N]
    out.index_add_(0, order, y.to(out.dtype))


def few_per_group(meta: ExpertStepMeta, top_k: int, num_experts: int) -> bool:
    """Whether a step's assignments spread thin over its (slot, expert) groups: at most
    ``ROWS_PER_GROUP`` per group on average for its busiest slot (decode: one row per slot, its
    k assignments on k experts), where the row path beats sorting into S * E segments."""
    return meta.max_slot_rows * top_k <= ROWS_PER_GROUP * num_experts


def add_expert_lora_rows(
    x: torch.Tensor,  # [P, K] fp32: the assignments' inputs
    token: torch.Tensor,  # [P]: each assignment's batch row
    expert: torch.Tensor,  # [P]: each assignment's expert
    a: torch.Tensor,  # [S, E, G * R, K]
    bs: list[torch.Tensor],  # G x [S, E, N_g, R]
    out: torch.Tensor,  # [P, sum N_g] fp32
    meta: ExpertStepMeta,
) -> None:
    """:func:`add_expert_lora` in the C++ row op (``kernels/cpu/lora.py``'s
    ``expert_lora_rows``): no sort, no segments; each assignment reads its (slot, expert) A
    and B from the storage and adds its delta in place (fp32 on the CPU, ops loaded)."""
    cols = [0]
    for b in bs[:-1]:
        cols.append(cols[-1] + b.shape[2])
    expert_lora_rows(x.contiguous(), token, expert, meta.row_slots, meta.row_scale, a, bs, cols,
                     meta.max_rank, out)


def add_expert_lora_triton(
    x: torch.Tensor,  # [P, K]: the assignments' inputs
    token: torch.Tensor,  # [P]: each assignment's batch row
    expert: torch.Tensor,  # [P]: each assignment's expert
    a: torch.Tensor,  # [S, E, G * R, K]
    bs: list[torch.Tensor],  # G x [S, E, N_g, R]
    out: torch.Tensor,  # [P, sum N_g]
    meta: ExpertStepMeta,
) -> None:
    """:func:`add_expert_lora` on the Triton kernel (``kernels/moe_lora.py``): no sort, no
    host read; each assignment's group is ``slot * E + expert``, -1 for rows without."""
    num_slots, num_experts, width, k = a.shape
    groups_n = num_slots * num_experts
    slot = meta.row_slots.index_select(0, token)  # [P]
    groups = torch.where(slot < num_slots, slot * num_experts + expert,
                         torch.full_like(slot, -1)).to(torch.int32)  # [P]
    scalings = meta.slot_scale.float().repeat_interleave(num_experts)  # [S * E]
    moe_lora(x, groups, a.reshape(groups_n, width, k),
             [b.reshape(groups_n, b.shape[2], b.shape[3]) for b in bs], scalings, out)
