"""Device storage for the adapters of a running batch: ``num_slots`` slots of rank up to R.

Per adaptable module ``m`` of the base model (``ModelConfig.lora_targets``: q, k, v, o, gate,
up, down for most families; Phi-3's fused qkv_proj, o_proj, gate_up_proj, down_proj)::

    a[m]: [num_layers, S, R, in_m]     lora_A of slot s in rows :rank_s, zeros beyond
    b[m]: [num_layers, S, out_m, R]    lora_B of slot s in columns :rank_s, zeros beyond

The A of projections that read the same input (q/k/v, gate/up) are views of one tensor per
group, ``a_groups[(q, k, v)]: [num_layers, S, 3 R, in]``, so one matmul shrinks that input for
every projection of the group; a module alone at its input has a group of its own.

(the ``A[S, R, K]`` / ``B[S, N, R]`` layout the SGMV kernels take, one layer at a time).

A mixture-of-experts base also gets expert storage, per routed expert ``e`` (``lora/experts.py``
computes the deltas)::

    expert_a_gate_up: [num_layers, S, E, 2 R, H]   gate's A in rows :R, up's A in rows R:
    expert_b_gate_up: [num_layers, S, E, 2 I, R]   gate's B in rows :I, up's B in rows I:
    expert_a_down:    [num_layers, S, E, R, I]
    expert_b_down:    [num_layers, S, E, H, R]

An adapter of PEFT's fused form (one A of ``gate_up_proj`` for gate and up) has its A copied
into both halves; the per-expert form (``experts.N.gate_proj``, ...) fills each on its own.
Bytes per slot: ``L * E * R * (2 H + 2 I + I + H) * itemsize``, e.g. Qwen3-30B-A3B's shape
(L 48, E 128, H 2048, I 768) at R 16 in bf16: 48 * 128 * 16 * 8448 * 2 = 1.66 GB.
The slot table is a plain list, slot -> adapter id or None (vLLM's ``lora_index_to_id``). Who
may overwrite a slot, and when, is decided by the adapter manager; this class only stores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from lorastream.core.adapter_format import per_expert
from lorastream.worker.model.config import ModelConfig

RANK_ALIGN = 8  # keeps every stride a multiple of 16 bytes (grouped_mm needs it) in fp16 and up
PIECE_BYTES = 1 << 20  # the most one copy operation moves (or one layer, if larger)


@dataclass(frozen=True)
class SlotInfo:
    adapter_id: str | None = None
    rank: int = 0
    scaling: float = 0.0
    modules: frozenset[str] = field(default_factory=frozenset)


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    target.copy_(source, non_blocking=True)


def _zero(target: torch.Tensor) -> None:
    target.zero_()


Blocks = list[tuple[int, str, str, torch.Tensor]]  # (first layer, module, "A"|"B", block)


def _covered(blocks: Blocks) -> dict[tuple[str, str], set[int]]:
    """(module, "A"|"B") -> the layers ``blocks`` write."""
    covered: dict[tuple[str, str], set[int]] = {}
    for layer, module, ab, block in blocks:
        covered.setdefault((module, ab), set()).update(range(layer, layer + block.shape[0]))
    return covered


def _dense(blocks: Blocks) -> Blocks:
    """The blocks of the dense slots (not a routed expert's: ``LoraSlots.expert_ops``)."""
    return [b for b in blocks if not b[1].startswith("experts.")]


def _slot_info(adapter_id: str, rank: int, scaling: float, blocks: Blocks) -> SlotInfo:
    return SlotInfo(adapter_id, rank, scaling, frozenset(module for _, module, _, _ in blocks))


class LoraSlots:
    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
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
        self._init_experts(config, dtype, device)

    def _init_experts(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        """Expert storage (module docstring); ``expert_a[p]``/``expert_b[p]`` are the views of
        projection ``p`` (gate_proj, up_proj, down_proj) a copy writes, [L, S, E, R, in] and
        [L, S, E, out, R]."""
        self.expert_a: dict[str, torch.Tensor] = {}
        self.expert_b: dict[str, torch.Tensor] = {}
        if not config.is_moe:
            return
        lay, s, e, r = config.num_layers, self.num_slots, config.num_experts, self.storage_rank
        h, i = config.hidden_size, config.moe_intermediate_size
        a_gate_up = torch.zeros((lay, s, e, 2, r, h), dtype=dtype, device=device)
        self.expert_a_gate_up = a_gate_up.view(lay, s, e, 2 * r, h)
        self.expert_b_gate_up = torch.zeros((lay, s, e, 2 * i, r), dtype=dtype, device=device)
        self.expert_a_down = torch.zeros((lay, s, e, r, i), dtype=dtype, device=device)
        self.expert_b_down = torch.zeros((lay, s, e, h, r), dtype=dtype, device=device)
        self.expert_a = {"gate_proj": a_gate_up[:, :, :, 0], "up_proj": a_gate_up[:, :, :, 1],
                         "down_proj": self.expert_a_down}
        self.expert_b = {"gate_proj": self.expert_b_gate_up[:, :, :, :i],
                         "up_proj": self.expert_b_gate_up[:, :, :, i:],
                         "down_proj": self.expert_b_down}

    @property
    def nbytes(self) -> int:
        experts = (self.expert_a_gate_up, self.expert_b_gate_up, self.expert_a_down,
                   self.expert_b_down) if self.expert_a else ()
        return sum(t.numel() * t.element_size()
                   for t in (*self.a.values(), *self.b.values(), *experts))

    def expert_ops(self, slot: int, rank: int, blocks: Blocks) -> list[list[Callable[[], None]]]:
        """Per layer, the operations that write ``blocks``' expert tensors into ``slot``: zero
        the slot's experts in that layer, then copy. Blocks of the fused form (module
        ``experts.gate_up_proj`` or ``experts.down_proj``): A ``[n, E * r, in]`` -- expert e's
        rows ``e r .. e r + r - 1`` -- and B ``[n, out, E * r]`` -- expert e's column j at
        ``j E + e`` (PEFT's ``ParamWrapper`` layout). Per-expert blocks (``experts.{e}.{proj}``):
        A ``[n, r, in]``, B ``[n, out, r]``."""
        by_layer: list[list[Callable[[], None]]] = [[] for _ in range(self.num_layers)]
        if not self.expert_a:
            return by_layer
        for layer in range(self.num_layers):
            for t in (self.expert_a_gate_up, self.expert_b_gate_up, self.expert_a_down,
                      self.expert_b_down):
                by_layer[layer].append(partial(_zero, t[layer, slot]))
        for first, module, ab, block in blocks:
            if not module.startswith("experts."):
                continue
            one = per_expert(module)
            for i in range(block.shape[0]):
                for target, source in self._expert_copies(first + i, slot, rank, module, one,
                                                          ab, block[i]):
                    by_layer[first + i].append(partial(_copy, target, source))
        return by_layer

    def _expert_copies(
        self, layer: int, slot: int, rank: int, module: str, one: tuple[int, str] | None,
        ab: str, block: torch.Tensor,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(target, source) pairs of one layer's expert tensor (:meth:`expert_ops`)."""
        if one is not None:
            expert, proj = one
            if ab == "A":
                return [(self.expert_a[proj][layer, slot, expert, :rank], block)]
            return [(self.expert_b[proj][layer, slot, expert, :, :rank], block)]
        e = self.expert_a_down.shape[2]
        gate_up = module == "experts.gate_up_proj"
        if ab == "A":  # [E r, in] -> [E, r, in]
            a = block.view(e, rank, -1)
            if gate_up:
                return [(self.expert_a["gate_proj"][layer, slot, :, :rank], a),
                        (self.expert_a["up_proj"][layer, slot, :, :rank], a)]
            return [(self.expert_a_down[layer, slot, :, :rank], a)]
        b = block.view(block.shape[0], rank, e).permute(2, 0, 1)  # [out, E r] -> [E, out, r]
        target = self.expert_b_gate_up if gate_up else self.expert_b_down
        return [(target[layer, slot, :, :, :rank], b)]

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
        """The operations that copy ``(first layer, module, "A"|"B", block)`` into ``slot``, to
        run in order on the load stream: zero what the blocks leave alone (ranks beyond ``rank``,
        the layers and modules the adapter does not adapt: the batched ops read them), copy each
        block of ``n`` consecutive layers (``[n, r, in]`` for A, ``[n, out, r]`` for B) a few
        layers at a time (at most ``piece_bytes``, or one layer), and finally record the slot's
        adapter. What the blocks overwrite is not zeroed first.

        Small operations let the CPU load stream copy in the gaps between decode steps
        (``step_gate.py``). Copies are non-blocking (pinned host memory on CUDA).
        """
        info = _slot_info(adapter_id, rank, scaling, blocks)
        ops: list[Callable[[], None]] = [
            op for layer_ops in self.expert_ops(slot, rank, blocks) for op in layer_ops
        ]
        blocks = _dense(blocks)
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
            else:
                target = self.b[module][layer : layer + block.shape[0], slot, :, :rank]
            layer_bytes = block[0].numel() * block.element_size()
            step = max(1, piece_bytes // max(layer_bytes, 1))
            for first in range(0, block.shape[0], step):
                part = slice(first, first + step)
                ops.append(partial(_copy, target[part], block[part]))
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
        scaling), job ``1 + l`` zeroes what layer ``l`` of the slot must not keep and copies the
        adapter's layer ``l`` in. Run in order, the jobs write what :meth:`write_ops` writes;
        after jobs ``0 .. l`` ran, layers ``0 .. l - 1`` of the slot are final.

        Example, 3 layers, q_proj adapted in layers 0 and 1 only: job 1 copies L0 q.A and q.B
        and zeroes L0 of every other module; job 3 zeroes L2 of every module.
        """
        num_layers = self.num_layers
        by_layer = self.expert_ops(slot, rank, blocks)
        info = _slot_info(adapter_id, rank, scaling, blocks)
        blocks = _dense(blocks)
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
            rows = self.a[module] if ab == "A" else self.b[module]
            for i in range(block.shape[0]):
                target = (rows[first + i, slot, :rank] if ab == "A"
                          else rows[first + i, slot, :, :rank])
                by_layer[first + i].append(partial(_copy, target, block[i]))
        return [[partial(self.table.__setitem__, slot, info)], *by_layer]

    def claim(self, slot: int, adapter_id: str) -> None:
        """Record ``slot`` as ``adapter_id``'s before its copy runs (the copy's last operation
        records its rank and scaling)."""
        self.table[slot] = SlotInfo(adapter_id)

    def clear(self, slot: int) -> None:
        """Forget the slot's adapter (its weights stay until the next write)."""
        self.table[slot] = SlotInfo()
