"""The LoRA delta for every token of a mixed batch in a few batched ops.

A backend turns the step's per-token slot indices into metadata once (:meth:`prepare`, on the
host, reused by every layer and module), then adds ``scaling * (x @ Aᵀ) @ Bᵀ`` into each
projection's output (:meth:`add`). Example, 5 tokens, slots [2, -1, 0, 2, 0]::

    order   = [2, 4, 0, 3]        rows with an adapter, sorted by slot (stable)
    offs    = [2, 2, 4]           end of each slot's group in ``order`` (slot 1 is empty)
    x[order] -> grouped_mm with A[s] per group -> grouped_mm with B[s] -> index_add into out

The torch backend uses ``torch.nn.functional.grouped_mm`` (segmented GEMM, the SGMV of Punica),
which reads each active adapter once and copies no weights; shapes whose strides grouped_mm
cannot take (not 16-byte multiples) fall back to gather + bmm. Cost follows the largest rank in
the batch (ranks are sliced to it), not the slot capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.gpu_worker.lora.slots import LoraSlots


@dataclass(frozen=True)
class LoraStepMeta:
    """Per-step metadata, built on the host and moved to the device once."""

    order: torch.Tensor  # [Tl] int64, rows with an adapter sorted by slot
    sorted_slots: torch.Tensor  # [Tl] int64, the slot of each of those rows
    offs: torch.Tensor  # [S] int32, cumulative group ends (grouped_mm)
    row_scale: torch.Tensor  # [Tl, 1], scaling of each sorted row (model dtype)
    max_rank: int
    modules: frozenset[str]  # modules some active adapter adapts


class LoraBackend(Protocol):
    name: str

    def prepare(self, token_slots: list[int], slots: LoraSlots) -> LoraStepMeta | None:
        """Metadata for rows whose slot is ``token_slots[row]`` (-1: base model)."""

    def add(
        self,
        x: torch.Tensor,  # [T, K]
        a: torch.Tensor,  # [S, R, K]
        b: torch.Tensor,  # [S, N, R]
        out: torch.Tensor,  # [T, N_total]
        col: int,
        meta: LoraStepMeta,
    ) -> None:
        """out[:, col:col+N] += scaling[s] * (x @ a[s, :r]ᵀ) @ b[s, :, :r]ᵀ per row."""


def build_meta(
    token_slots: list[int], slots: LoraSlots, dtype: torch.dtype, device: torch.device
) -> LoraStepMeta | None:
    """Sort rows by slot on the host; None when no row has an adapter."""
    rows = sorted((s, i) for i, s in enumerate(token_slots) if s >= 0)
    if not rows:
        return None
    counts = [0] * slots.num_slots
    for s, _ in rows:
        counts[s] += 1
    ends, total = [], 0
    for c in counts:
        total += c
        ends.append(total)
    active = {s for s, _ in rows}
    table = slots.table
    order = torch.tensor([i for _, i in rows], dtype=torch.long)
    sorted_slots = torch.tensor([s for s, _ in rows], dtype=torch.long)
    scale = torch.tensor([[table[s].scaling] for s, _ in rows], dtype=dtype)
    modules = frozenset().union(*(table[s].modules for s in active))
    non_blocking = device.type == "cuda"
    return LoraStepMeta(
        order=order.to(device, non_blocking=non_blocking),
        sorted_slots=sorted_slots.to(device, non_blocking=non_blocking),
        offs=torch.tensor(ends, dtype=torch.int32).to(device, non_blocking=non_blocking),
        row_scale=scale.to(device, non_blocking=non_blocking),
        max_rank=max(table[s].rank for s in active),
        modules=modules,
    )


def _grouped_ok(t: torch.Tensor) -> bool:
    """grouped_mm needs every non-unit stride to be a multiple of 16 bytes."""
    size = t.element_size()
    return all(st * size % 16 == 0 for st, n in zip(t.stride(), t.shape) if st != 1 and n > 1)


class TorchLoraBackend:
    """Segmented GEMM with ``grouped_mm`` (gather + bmm for unaligned shapes)."""

    name = "torch"

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self._dtype = dtype
        self._device = device

    def prepare(self, token_slots: list[int], slots: LoraSlots) -> LoraStepMeta | None:
        return build_meta(token_slots, slots, self._dtype, self._device)

    def add(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        col: int,
        meta: LoraStepMeta,
    ) -> None:
        r = meta.max_rank
        n = b.shape[1]
        xs = x.index_select(0, meta.order)  # [Tl, K]
        a_t = a[:, :r].transpose(1, 2)  # [S, K, r]
        b_t = b[:, :, :r].transpose(1, 2)  # [S, r, N]
        if _grouped_ok(xs) and _grouped_ok(a_t) and _grouped_ok(b_t):
            h = F.grouped_mm(xs, a_t, offs=meta.offs)  # [Tl, r]
            y = F.grouped_mm(h, b_t, offs=meta.offs)  # [Tl, N]
        else:
            h = torch.bmm(xs.unsqueeze(1), a_t[meta.sorted_slots])  # [Tl, 1, r]
            y = torch.bmm(h, b_t[meta.sorted_slots]).squeeze(1)  # [Tl, N]
        out[:, col : col + n].index_add_(0, meta.order, y * meta.row_scale)


class LoraStep:
    """The model's LoRA hook for one step: slots + backend + this step's metadata."""

    def __init__(self, slots: LoraSlots, backend: LoraBackend, meta: LoraStepMeta) -> None:
        self._slots = slots
        self._backend = backend
        self._meta = meta

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor, col: int) -> None:
        if module in self._meta.modules:
            self._backend.add(
                x, self._slots.a[module][layer], self._slots.b[module][layer], out, col, self._meta
            )
