"""Device storage for the adapters of a running batch: ``num_slots`` slots of rank up to R.

Per adaptable module ``m`` of the base model (``ModelConfig.lora_targets``: q, k, v, o, gate,
up, down for most families; Phi-3's fused qkv_proj, o_proj, gate_up_proj, down_proj)::

    a[m]: [num_layers, S, R, in_m]     lora_A of slot s in rows :rank_s, zeros beyond
    b[m]: [num_layers, S, out_m, R]    lora_B of slot s in columns :rank_s, zeros beyond

The A of projections that read the same input (q/k/v, gate/up) are views of one tensor per
group, ``a_groups[(q, k, v)]: [num_layers, S, 3 R, in]``, so one matmul shrinks that input for
every projection of the group; a module alone at its input has a group of its own.

(the ``A[S, R, K]`` / ``B[S, N, R]`` layout the SGMV kernels take, one layer at a time).

DoRA slots (an adapter with magnitude vectors ``m``) also hold a factor per output row, taken
once when the adapter is placed (the base weights never change), so a DoRA step is a LoRA step
and one multiply (``LoraStep``)::

    dora_scale[m]: [num_layers, S + 1, out_m]   m / ||W + scaling B A|| per row (PEFT's DoRA)
    dora_shift[m]: [num_layers, S + 1, out_m]   (1 - dora_scale) * bias, for projections with
                                                a bias only (the bias is not rescaled)

Entry ``S`` is the identity (scale 1, shift 0), which every row not of a DoRA slot reads;
entries of slots holding a plain LoRA are never read. The norm is over the weight the base
projection computes with (``DoraBase``; int8/fp8: the dequantized weight).
The slot table is a plain list, slot -> adapter id or None (vLLM's ``lora_index_to_id``). Who
may overwrite a slot, and when, is decided by the adapter manager; this class only stores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch

from lorastream.core.adapter_format import MAGNITUDE
from lorastream.worker.model.config import ModelConfig

RANK_ALIGN = 8  # keeps every stride a multiple of 16 bytes (grouped_mm needs it) in fp16 and up
PIECE_BYTES = 1 << 20  # the most one copy operation moves (or one layer, if larger)


@dataclass(frozen=True)
class SlotInfo:
    adapter_id: str | None = None
    rank: int = 0
    scaling: float = 0.0
    modules: frozenset[str] = field(default_factory=frozenset)
    dora: bool = False  # its rows take the slot's dora_scale (and dora_shift)


class DoraBase(Protocol):
    """What a DoRA slot needs of the base model (``DecoderModel``)."""

    def dora_norms(
        self, layer: int, module: str, b: torch.Tensor, a: torch.Tensor
    ) -> torch.Tensor:
        """``||W + b @ a||`` per output row of ``module`` in ``layer``: b [N, r], a [r, K] ->
        [N] fp32."""

    def lora_bias(self, layer: int, module: str) -> torch.Tensor | None:
        """``module``'s bias in ``layer`` [N], None if it has none."""


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    target.copy_(source, non_blocking=True)


Blocks = list[tuple[int, str, str, torch.Tensor]]  # (first layer, module, "A"|"B"|"M", block)


def _covered(blocks: Blocks) -> dict[tuple[str, str], set[int]]:
    """(module, "A"|"B") -> the layers ``blocks`` write."""
    covered: dict[tuple[str, str], set[int]] = {}
    for layer, module, ab, block in blocks:
        covered.setdefault((module, ab), set()).update(range(layer, layer + block.shape[0]))
    return covered


def _slot_info(adapter_id: str, rank: int, scaling: float, blocks: Blocks) -> SlotInfo:
    return SlotInfo(adapter_id, rank, scaling, frozenset(module for _, module, _, _ in blocks),
                    dora=any(ab == MAGNITUDE for _, _, ab, _ in blocks))


class LoraSlots:
    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        base: DoraBase | None = None,
    ) -> None:
        """``base``: the model DoRA adapters are placed over (without it, a DoRA write fails)."""
        self.num_slots = num_slots
        self.num_layers = config.num_layers
        self.max_rank = max_rank
        self.storage_rank = storage_rank = -(-max_rank // RANK_ALIGN) * RANK_ALIGN
        shapes = config.module_shapes()
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        # a_groups[group]: [L, S, G * R, in], the A of G modules that read the same input, so
        # that one matmul shrinks it for all of them; a[m] is a view of its part, [L, S, R, in].
        self.a_groups: dict[tuple[str, ...], torch.Tensor] = {}
        # Projections that read the same input (the base model fuses them too) share A storage.
        shared = config.shared_input_groups()
        grouped = {m for group in shared for m in group}
        groups = [*shared, *((m,) for m in shapes if m not in grouped)]
        for group in groups:
            fan_in = shapes[group[0]][0]
            assert all(shapes[m][0] == fan_in for m in group), f"{group} read different inputs"
            fused = torch.zeros(
                (config.num_layers, num_slots, len(group), storage_rank, fan_in),
                dtype=dtype, device=device,
            )
            self.a_groups[group] = fused.view(config.num_layers, num_slots, -1, fan_in)
            for index, module in enumerate(group):
                self.a[module] = fused[:, :, index]
        for module, (_, fan_out) in shapes.items():
            self.b[module] = torch.zeros(
                (config.num_layers, num_slots, fan_out, storage_rank), dtype=dtype, device=device
            )
        self.table: list[SlotInfo] = [SlotInfo() for _ in range(num_slots)]
        self.base = base
        # DoRA's factors (module docstring); entry num_slots is the identity
        self.dora_scale: dict[str, torch.Tensor] = {
            module: torch.ones((config.num_layers, num_slots + 1, fan_out), dtype=dtype,
                               device=device)
            for module, (_, fan_out) in shapes.items()
        }
        self.dora_shift: dict[str, torch.Tensor] = {
            module: torch.zeros_like(self.dora_scale[module])
            for module in shapes if base is not None and base.lora_bias(0, module) is not None
        }

    @property
    def nbytes(self) -> int:
        tensors = (*self.a.values(), *self.b.values(), *self.dora_scale.values(),
                   *self.dora_shift.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def identity(self) -> int:
        """The entry of ``dora_scale`` / ``dora_shift`` that leaves a row as it is."""
        return self.num_slots

    def _dora_ops(
        self, slot: int, rank: int, scaling: float, blocks: Blocks, layer: int
    ) -> list[Callable[[], None]]:
        """For a DoRA adapter, what sets ``layer``'s factors of ``slot`` once its A, B and
        magnitudes are copied in: each adapted module's, and the identity for the rest;
        nothing for a plain LoRA."""
        if not any(ab == MAGNITUDE for _, _, ab, _ in blocks):
            return []
        adapted = _covered(blocks)
        ops: list[Callable[[], None]] = []
        for module, scale in self.dora_scale.items():
            if layer in adapted.get((module, MAGNITUDE), ()):
                ops.append(partial(self._set_dora_factor, slot, layer, module, rank, scaling))
                continue
            ops.append(partial(scale[layer, slot].fill_, 1.0))
            if module in self.dora_shift:
                ops.append(self.dora_shift[module][layer, slot].zero_)
        return ops

    def _set_dora_factor(self, slot: int, layer: int, module: str, rank: int, scaling: float
                         ) -> None:
        """dora_scale = m / ||W + scaling B A|| per output row (it holds the magnitude m when
        this runs), and dora_shift = (1 - dora_scale) * bias: PEFT's DoRA, whose result is
        ``dora_scale * (W x + scaling B A x) + bias``."""
        if self.base is None:
            raise RuntimeError("a DoRA adapter needs LoraSlots(base=the model) to be placed")
        a = self.a[module][layer, slot, :rank]  # [r, K]
        b = self.b[module][layer, slot, :, :rank]  # [N, r]
        scale = self.dora_scale[module][layer, slot]  # [N], the magnitude m until now
        norm = self.base.dora_norms(layer, module, b * scaling, a)  # [N] fp32
        factor = scale.float() / norm  # [N]
        scale.copy_(factor)
        if module in self.dora_shift:
            bias = self.base.lora_bias(layer, module)
            assert bias is not None
            self.dora_shift[module][layer, slot].copy_((1 - factor) * bias.float())

    def slot_of(self, adapter_id: str) -> int | None:
        for index, info in enumerate(self.table):
            if info.adapter_id == adapter_id:
                return index
        return None

    def write(
        self,
        slot: int,
        adapter_id: str,
        rank: int,
        scaling: float,
        blocks: list[tuple[int, str, str, torch.Tensor]],
    ) -> None:
        """Copy an adapter into ``slot`` at once (:meth:`write_ops`, run in order)."""
        for op in self.write_ops(slot, adapter_id, rank, scaling, blocks):
            op()

    def write_ops(
        self,
        slot: int,
        adapter_id: str,
        rank: int,
        scaling: float,
        blocks: list[tuple[int, str, str, torch.Tensor]],
        piece_bytes: int = PIECE_BYTES,
    ) -> list[Callable[[], None]]:
        """The operations that copy ``(first layer, module, "A"|"B"|"M", block)`` into ``slot``, to
        run in order on the load stream: zero what the blocks leave alone (ranks beyond ``rank``,
        the layers and modules the adapter does not adapt: the batched ops read them), copy each
        block of ``n`` consecutive layers (``[n, r, in]`` for A, ``[n, out, r]`` for B) a few
        layers at a time (at most ``piece_bytes``, or one layer), for a DoRA adapter (``"M"``
        blocks ``[n, out]``) set each layer's factors (:meth:`_dora_ops`), and finally record
        the slot's adapter. What the blocks overwrite is not zeroed first.

        Small operations let the CPU load stream copy in the gaps between decode steps
        (``step_gate.py``). Copies are non-blocking (pinned host memory on CUDA).
        """
        ops: list[Callable[[], None]] = []
        covered = _covered(blocks)
        for module in self.a:
            a, b = self.a[module][:, slot], self.b[module][:, slot]  # [L, R, in], [L, out, R]
            for ab, rows in (("A", a), ("B", b)):
                layers = covered.get((module, ab), set())
                if not layers:
                    ops.append(rows.zero_)
                    continue
                if rank < self.storage_rank:
                    ops.append((rows[:, rank:] if ab == "A" else rows[:, :, rank:]).zero_)
                ops.extend(rows[layer].zero_ for layer in set(range(rows.shape[0])) - layers)
        for layer, module, ab, block in blocks:
            if ab == "A":
                target = self.a[module][layer : layer + block.shape[0], slot, :rank]
            elif ab == MAGNITUDE:  # [n, out]: the factor's numerator, divided below
                target = self.dora_scale[module][layer : layer + block.shape[0], slot]
            else:
                target = self.b[module][layer : layer + block.shape[0], slot, :, :rank]
            layer_bytes = block[0].numel() * block.element_size()
            step = max(1, piece_bytes // max(layer_bytes, 1))
            for first in range(0, block.shape[0], step):
                part = slice(first, first + step)
                ops.append(partial(_copy, target[part], block[part]))
        for layer in range(self.num_layers):
            ops.extend(self._dora_ops(slot, rank, scaling, blocks, layer))
        info = _slot_info(adapter_id, rank, scaling, blocks)
        ops.append(partial(self.table.__setitem__, slot, info))
        return ops

    def layer_write_ops(
        self,
        slot: int,
        adapter_id: str,
        rank: int,
        scaling: float,
        blocks: list[tuple[int, str, str, torch.Tensor]],
    ) -> list[list[Callable[[], None]]]:
        """:meth:`write_ops` split by layer, for an adapter whose layers land one after another:
        job 0 records the slot's adapter (a prefill that runs the first layers reads its rank and
        scaling), job ``1 + l`` zeroes what layer ``l`` of the slot must not keep, copies the
        adapter's layer ``l`` in and (DoRA) sets its factors. Run in order, the jobs write what
        :meth:`write_ops` writes; after jobs ``0 .. l`` ran, layers ``0 .. l - 1`` of the slot
        are final.

        Example, 3 layers, q_proj adapted in layers 0 and 1 only: job 1 copies L0 q.A and q.B
        and zeroes L0 of every other module; job 3 zeroes L2 of every module.
        """
        num_layers = self.num_layers
        by_layer: list[list[Callable[[], None]]] = [[] for _ in range(num_layers)]
        covered = _covered(blocks)
        for module in self.a:
            a, b = self.a[module][:, slot], self.b[module][:, slot]  # [L, R, in], [L, out, R]
            for ab, rows in (("A", a), ("B", b)):
                layers = covered.get((module, ab), set())
                for layer in range(num_layers):
                    if layer not in layers:
                        by_layer[layer].append(rows[layer].zero_)
                    elif rank < self.storage_rank:
                        tail = rows[layer, rank:] if ab == "A" else rows[layer, :, rank:]
                        by_layer[layer].append(tail.zero_)
        for first, module, ab, block in blocks:
            rows = {"A": self.a, "B": self.b, MAGNITUDE: self.dora_scale}[ab][module]
            for i in range(block.shape[0]):
                target = (rows[first + i, slot, :rank] if ab == "A"
                          else rows[first + i, slot, :, :rank] if ab == "B"
                          else rows[first + i, slot])
                by_layer[first + i].append(partial(_copy, target, block[i]))
        for layer in range(num_layers):
            by_layer[layer].extend(self._dora_ops(slot, rank, scaling, blocks, layer))
        info = _slot_info(adapter_id, rank, scaling, blocks)
        return [[partial(self.table.__setitem__, slot, info)], *by_layer]

    def claim(self, slot: int, adapter_id: str) -> None:
        """Record ``slot`` as ``adapter_id``'s before its copy runs (the copy's last operation
        records its rank and scaling)."""
        self.table[slot] = SlotInfo(adapter_id)

    def clear(self, slot: int) -> None:
        """Forget the slot's adapter (its weights stay until the next write)."""
        self.table[slot] = SlotInfo()
