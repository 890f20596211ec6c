"""The LoRA delta with the Triton SGMV kernels of ``lorastream/kernels/`` (CUDA; the CPU runs
them only in Triton's interpreter, for tests). Same contract as the torch backend: metadata built
on the host once per step (``SgmvMetadata``), reused by every layer's shrink and expand. A MoE
base's expert deltas run the expert kernel (``kernels/moe_lora.py``) over (slot, expert) groups.

A step with a weighted mix row (``backend.py``, "Weighted mixes") is routed to the torch
backend's entry layout, on the same device: the SGMV kernels take one slot per row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorastream.core.errors import InvalidArgument
from lorastream.kernels.metadata import SgmvMetadata
from lorastream.kernels.sgmv import check_available, sgmv_expand, sgmv_shrink
from lorastream.worker.device.step_arena import Arena
from lorastream.worker.lora.backend import (
    DoraRows,
    LoraStepMeta,
    MixEntries,
    TorchLoraBackend,
    build_dora_rows,
)
from lorastream.worker.lora.experts import ExpertStepMeta, add_expert_lora_triton
from lorastream.worker.lora.slots import LoraSlots


@dataclass(frozen=True)
class TritonStepMeta:
    sgmv: SgmvMetadata
    token_slots: torch.Tensor  # [T] int32 on the device, -1 = base model
    ranks: torch.Tensor  # [S] int32
    scalings: torch.Tensor  # [S] float32
    modules: frozenset[str]
    dora: DoraRows | None  # applied by LoraStep after the delta


class TritonLoraBackend:
    name = "triton"

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        try:
            check_available(device)
        except RuntimeError as err:
            raise InvalidArgument(f"--lora-backend triton cannot run here: {err}") from err
        self._dtype = dtype
        self._device = device
        self._mixes = TorchLoraBackend(dtype, device)  # steps with a mix row (module docstring)

    def prepare(
        self, token_slots: list[int], slots: LoraSlots, arena: Arena | None = None,
        mixes: MixEntries | None = None,
    ) -> TritonStepMeta | LoraStepMeta | None:
        """The SGMV metadata travels in its own transfer (``SgmvMetadata.from_slots``); a step
        with a mix row gets the torch backend's metadata."""
        if mixes is not None:
            return self._mixes.prepare(token_slots, slots, arena, mixes)
        active = {s for s in token_slots if s >= 0}
        if not active:
            return None
        table = slots.table
        slots_cpu = torch.tensor(token_slots, dtype=torch.int32)  # [T]
        ranks_cpu = torch.tensor([info.rank for info in table], dtype=torch.int32)  # [S]
        scalings_cpu = torch.tensor([info.scaling for info in table], dtype=torch.float32)
        non_blocking = self._device.type == "cuda"
        return TritonStepMeta(
            sgmv=SgmvMetadata.from_slots(slots_cpu, ranks_cpu, self._device),
            token_slots=slots_cpu.to(self._device, non_blocking=non_blocking),
            ranks=ranks_cpu.to(self._device, non_blocking=non_blocking),
            scalings=scalings_cpu.to(self._device, non_blocking=non_blocking),
            modules=frozenset().union(*(table[s].modules for s in active)),
            dora=build_dora_rows(
                token_slots, slots,
                lambda v: torch.tensor(v, dtype=torch.long).to(self._device,
                                                              non_blocking=non_blocking),
            ),
        )

    def add(
        self,
        x: torch.Tensor,  # [T, K]
        a: torch.Tensor,  # [S, R, K]
        b: torch.Tensor,  # [S, N, R]
        out: torch.Tensor,  # [T, N_total]
        col: int,
        meta: TritonStepMeta | LoraStepMeta,
    ) -> None:
        if isinstance(meta, LoraStepMeta):  # a step with a mix row
            self._mixes.add(x, a, b, out, col, meta)
            return
        h = sgmv_shrink(x, a, meta.token_slots, meta.ranks, meta=meta.sgmv)  # [T, R] fp32
        sgmv_expand(
            h, b, meta.token_slots, meta.ranks, meta.scalings, out, slice_offset=col,
            meta=meta.sgmv,
        )

    def add_experts(
        self, x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, a: torch.Tensor,
        bs: list[torch.Tensor], out: torch.Tensor, meta: ExpertStepMeta,
    ) -> None:
        """A MoE layer's expert deltas on the expert kernel (``add_expert_lora_triton``)."""
        add_expert_lora_triton(x, token, expert, a, bs, out, meta)
