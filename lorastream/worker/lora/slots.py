"""Device storage for the adapters of a running batch: ``num_slots`` slots of rank up to R.

Per adaptable module ``m`` of the base model (``ModelConfig.lora_targets``: q, k, v, o, gate,
up, down for most families; Phi-3's fused qkv_proj, o_proj, gate_up_proj, down_proj)::

    a[m]: [num_layers, S, R, in_m]     lora_A of slot s in rows :r, zeros beyond
    b[m]: [num_layers, S, out_m, R]    lora_B of slot s in columns :r, zeros beyond

``r`` is the module's own rank: the adapter's rank ``rank_s`` unless PEFT's ``rank_pattern``
gives the module a smaller one (zeros pad it to ``rank_s``, which the batched ops read). Each
slot has one scaling; a module of its own scaling (``alpha_pattern``, or its own rank) has the
ratio of the two folded into its B once, when placed (``Folds``), so a step never asks.

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

A mixture-of-experts base also gets expert storage, per routed expert ``e`` (``lora/experts.py``
computes the deltas), for its sparse layers only (``L_moe`` of them: a dense layer of
``mlp_only_layers`` / off ``decoder_sparse_step`` has no experts to adapt); model layer ``l`` is
row ``expert_rows[l]``::

    expert_a_gate_up: [L_moe, S, E, 2 R, H]   gate's A in rows :R, up's A in rows R:
    expert_b_gate_up: [L_moe, S, E, 2 I, R]   gate's B in rows :I, up's B in rows I:
    expert_a_down:    [L_moe, S, E, R, I]
    expert_b_down:    [L_moe, S, E, H, R]

An adapter of PEFT's fused form (one A of ``gate_up_proj`` for gate and up) has its A copied
into both halves; the per-expert form (``experts.N.gate_proj``, ...) fills each on its own.
Bytes per slot: ``L_moe * E * R * (2 H + 2 I + I + H) * itemsize`` (:attr:`expert_nbytes` for
all slots), e.g. Qwen3-30B-A3B's shape
(L 48, E 128, H 2048, I 768) at R 16 in bf16: 48 * 128 * 16 * 8448 * 2 = 1.66 GB.
An adapter's vocabulary modules (new token rows, LoRA on embed_tokens / lm_head, saved whole
modules) live beside the slot, in ``vocab[slot]``, sized by the adapter (``lora/vocab.py``),
within :attr:`LoraSlots.vocab_budget` for all slots together.

The slot table is a plain list, slot -> adapter id or None (vLLM's ``lora_index_to_id``). Who
may overwrite a slot, and when, is decided by the adapter manager; this class only stores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch

from lorastream.core.adapter_format import MAGNITUDE, VOCAB_MODULES, per_expert
from lorastream.worker.lora.vocab import VocabBudget, VocabParts, plan_parts, token_width
from lorastream.worker.model.config import ModelConfig

RANK_ALIGN = 8  # keeps every stride a multiple of 16 bytes (grouped_mm needs it) in fp16 and up
PIECE_BYTES = 1 << 20  # the most one copy operation moves (or one layer, if larger)
VOCAB_BYTES = 1 << 30  # default budget of the slots' vocabulary modules (--lora-vocab-bytes)


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


Op = Callable[[], None]  # one load-stream operation
Blocks = list[tuple[int, str, str, torch.Tensor]]  # (first layer, module, "A"|"B"|"M", block)
# (layer, module as blocks name it, ratio): the module's scaling over the slot's, multiplied
# into its B after the copy (module docstring); layers and modules not listed have ratio 1
Folds = tuple[tuple[int, str, float], ...]


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    target.copy_(source, non_blocking=True)


def _zero(target: torch.Tensor) -> None:
    target.zero_()


def _fill(target: torch.Tensor, value: float) -> None:
    target.fill_(value)


def _scale(target: torch.Tensor, ratio: float) -> None:
    target.mul_(ratio)


def _runs(first: int, stop: int, covered: dict[int, int]) -> list[tuple[int, int, int]]:
    """Layers ``first .. stop - 1`` as runs of consecutive layers of one rank in ``covered``
    (layer -> rank), 0 for the layers it leaves out: ``(start, end, rank)``. Example: 0..5 with
    {1: 8, 2: 8, 3: 4} -> (0, 1, 0), (1, 3, 8), (3, 4, 4), (4, 5, 0)."""
    runs: list[tuple[int, int, int]] = []
    for layer in range(first, stop):
        rank = covered.get(layer, 0)
        if runs and runs[-1][2] == rank:
            runs[-1] = (runs[-1][0], layer + 1, rank)
        else:
            runs.append((layer, layer + 1, rank))
    return runs


@dataclass(frozen=True, eq=False)
class SlotCopy:
    """The copy of one adapter into one slot, as operations for the load stream to run in order.

    :meth:`layers` makes layers ``first .. stop - 1`` of the slot the adapter's: it zeroes what
    the blocks leave alone there (ranks beyond each module's, the layers and modules the
    adapter does not adapt: the batched ops read them), copies the blocks' layers in, a few
    layers at a time (at most ``piece_bytes``, or one layer), multiplies the B of each
    module of its own scaling by its ``folds`` ratio, and for a DoRA adapter (``"M"`` blocks
    ``[n, out]``) sets each layer's factors (:meth:`LoraSlots.dora_ops`). :meth:`record` writes
    the slot's table entry (adapter, rank, scaling). Two ways to run it:

    - whole (:meth:`whole`, an adapter landed whole): ``layers(0, L)``, then the record;
    - layer by layer (layer-ordered admission): the record first (a prefill over the first
      layers reads its rank and scaling), then ``layers(l, l + 1)`` as layer ``l`` lands.

    Either way the slot ends the same. Example, 3 layers, q_proj adapted in layers 0 and 1
    only: ``layers(0, 1)`` zeroes L0 of every other module and copies L0 of q.A and q.B;
    ``layers(2, 3)`` zeroes L2 of every module; ``layers(0, 3)`` zeroes L0-2 of every other
    module and L2 of q_proj in one operation each, and copies L0-1 of q.A and of q.B in one.
    What the blocks overwrite is not zeroed first. Small operations let the CPU load stream copy
    in the gaps between decode steps (``device/cpu/step_gate.py``); copies are non-blocking
    (pinned host memory on CUDA).
    """

    slots: LoraSlots
    slot: int
    info: SlotInfo
    blocks: Blocks
    covered: dict[tuple[str, str], dict[int, int]]  # (module, "A"|"B") -> {layer: its rank}
    piece_bytes: int = PIECE_BYTES
    vocab: VocabParts | None = None  # its vocabulary modules' storage (lora/vocab.py)
    vocab_ops: list[Op] = field(default_factory=list)  # the copies into ``vocab``
    folds: Folds = ()  # (layer, module, ratio): B rescaled to the slot's scaling

    @property
    def num_layers(self) -> int:
        return self.slots.num_layers

    def record(self) -> None:
        self.slots.table[self.slot] = self.info
        self.slots.set_vocab(self.slot, self.vocab)

    def whole(self) -> list[Op]:
        """Every layer's operations, then the record."""
        return [*self.layers(0, self.num_layers), self.record]

    def layers(self, first: int, stop: int) -> list[Op]:
        """The operations that make layers ``first .. stop - 1`` of the slot the adapter's."""
        ops: list[Op] = list(self.vocab_ops) if first == 0 else []  # streamed before layer 0
        slots, slot, rank, covered = self.slots, self.slot, self.info.rank, self.covered
        for layer in range(first, stop):  # a MoE base's routed experts (lora/experts.py)
            ops.extend(slots.expert_ops(slot, self.blocks, layer, self.folds))
        for module in slots.a:
            a, b = slots.a[module][:, slot], slots.b[module][:, slot]  # [L, R, in], [L, out, R]
            for ab, rows in (("A", a), ("B", b)):
                for start, end, r in _runs(first, stop, covered.get((module, ab), {})):
                    if not r:
                        ops.append(partial(_zero, rows[start:end]))
                    elif r < slots.storage_rank:  # the ranks beyond the module's
                        tail = rows[start:end, r:] if ab == "A" else rows[start:end, :, r:]
                        ops.append(partial(_zero, tail))
        for layer, module, ab, block in self.blocks:
            lo, hi = max(first, layer), min(stop, layer + block.shape[0])
            if lo >= hi or module.startswith("experts.") or module in VOCAB_MODULES:
                continue
            if ab == "A":  # block [n, r, in]
                target = slots.a[module][:, slot, : block.shape[1]]  # [L, r, in]
            elif ab == MAGNITUDE:  # [L, out]: the factor's numerator, divided below
                target = slots.dora_scale[module][:, slot]
            else:  # block [n, out, r]
                target = slots.b[module][:, slot, :, : block.shape[2]]  # [L, out, r]
            layer_bytes = block[0].numel() * block.element_size()
            step = max(1, self.piece_bytes // max(layer_bytes, 1))
            for start in range(lo, hi, step):
                end = min(start + step, hi)
                ops.append(partial(_copy, target[start:end], block[start - layer : end - layer]))
        for layer, module, ratio in self.folds:  # after the copies, before DoRA's norms
            if first <= layer < stop and module in slots.b:
                ops.append(partial(_scale, slots.b[module][layer, slot], ratio))
        for layer in range(first, stop):  # DoRA: each layer's factors once its tensors landed
            ops.extend(slots.dora_ops(slot, rank, self.info.scaling, self.blocks, layer))
        return ops


def _covered(blocks: Blocks) -> dict[tuple[str, str], dict[int, int]]:
    """(module, "A"|"B"|"M") -> {layer ``blocks`` write: the module's rank there} (A
    ``[n, r, in]``, B ``[n, out, r]``; a magnitude's rank is its width, unused)."""
    covered: dict[tuple[str, str], dict[int, int]] = {}
    for layer, module, ab, block in blocks:
        rank = block.shape[1] if ab == "A" else block.shape[-1]
        covered.setdefault((module, ab), {}).update(
            dict.fromkeys(range(layer, layer + block.shape[0]), rank))
    return covered


class LoraSlots:
    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        base: DoraBase | None = None,
        vocab_bytes: int = VOCAB_BYTES,
    ) -> None:
        """``base``: the model DoRA adapters are placed over (without it, a DoRA write fails);
        ``vocab_bytes``: what the slots' vocabulary modules may take, all together."""
        self.num_slots = num_slots
        self.vocab_budget = VocabBudget(vocab_bytes, torch.empty((), dtype=dtype).element_size())
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
        self.vocab: dict[int, VocabParts] = {}  # slot -> its adapter's vocabulary modules
        self.tied = config.tie_word_embeddings  # new embedding rows reach the logits too
        self._dtype, self._device = dtype, device
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
        self._init_experts(config, dtype, device)

    @property
    def nbytes(self) -> int:
        """Device bytes of every slot's storage: the projections', DoRA's and the experts'."""
        tensors = (*self.a.values(), *self.b.values(), *self.dora_scale.values(),
                   *self.dora_shift.values())
        return sum(t.numel() * t.element_size() for t in tensors) + self.expert_nbytes

    @property
    def expert_nbytes(self) -> int:
        """Device bytes of the expert storage, every slot's (0 on a dense base)."""
        if not self.expert_a:
            return 0
        return sum(t.numel() * t.element_size() for t in (
            self.expert_a_gate_up, self.expert_b_gate_up, self.expert_a_down, self.expert_b_down))

    @property
    def vocab_nbytes(self) -> int:
        """Bytes the slots' vocabulary modules take (beside :attr:`nbytes`)."""
        return sum(p.nbytes for p in self.vocab.values())

    @property
    def token_width(self) -> int:
        """The most new token rows of any slot's adapter (0: none has any)."""
        return token_width(self.vocab)

    def set_vocab(self, slot: int, parts: VocabParts | None) -> None:
        if parts is None:
            self.vocab.pop(slot, None)
        else:
            self.vocab[slot] = parts

    @property
    def identity(self) -> int:
        """The entry of ``dora_scale`` / ``dora_shift`` that leaves a row as it is."""
        return self.num_slots

    def dora_ops(
        self, slot: int, rank: int, scaling: float, blocks: Blocks, layer: int
    ) -> list[Op]:
        """For a DoRA adapter, what sets ``layer``'s factors of ``slot`` once its A, B and
        magnitudes are copied in: each adapted module's, and the identity for the rest;
        nothing for a plain LoRA."""
        if not any(ab == MAGNITUDE for _, _, ab, _ in blocks):
            return []
        adapted = _covered(blocks)
        ops: list[Op] = []
        for module, scale in self.dora_scale.items():
            if layer in adapted.get((module, MAGNITUDE), ()):
                ops.append(partial(self._set_dora_factor, slot, layer, module, rank, scaling))
                continue
            ops.append(partial(_fill, scale[layer, slot], 1.0))
            if module in self.dora_shift:
                ops.append(partial(_zero, self.dora_shift[module][layer, slot]))
        return ops

    def _set_dora_factor(self, slot: int, layer: int, module: str, rank: int, scaling: float
                         ) -> None:
        """dora_scale = m / ||W + scaling B A|| per output row (it holds the magnitude m when
        this runs), and dora_shift = (1 - dora_scale) * bias: PEFT's DoRA, whose result is
        ``dora_scale * (W x + scaling B A x) + bias``."""
        if self.base is None:
            raise RuntimeError("a DoRA adapter needs LoraSlots(base=the model) to be placed")
        a = self.a[module][layer, slot, :rank]  # [r, K], zeros beyond the module's rank
        b = self.b[module][layer, slot, :, :rank]  # [N, r], its scaling's ratio folded in
        scale = self.dora_scale[module][layer, slot]  # [N], the magnitude m until now
        norm = self.base.dora_norms(layer, module, b * scaling, a)  # [N] fp32
        factor = scale.float() / norm  # [N]
        scale.copy_(factor)
        if module in self.dora_shift:
            bias = self.base.lora_bias(layer, module)
            assert bias is not None
            self.dora_shift[module][layer, slot].copy_((1 - factor) * bias.float())

    def _init_experts(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        """Expert storage (module docstring); ``expert_a[p]``/``expert_b[p]`` are the views of
        projection ``p`` (gate_proj, up_proj, down_proj) a copy writes, [L, S, E, R, in] and
        [L, S, E, out, R]."""
        self.expert_a: dict[str, torch.Tensor] = {}
        self.expert_b: dict[str, torch.Tensor] = {}
        # model layer -> its row of the expert storage (sparse layers only)
        self.expert_rows: dict[int, int] = {}
        if not config.is_moe:
            return
        sparse = [layer for layer in range(config.num_layers) if config.is_moe_layer(layer)]
        self.expert_rows = {layer: row for row, layer in enumerate(sparse)}
        lay, s, e, r = len(sparse), self.num_slots, config.num_experts, self.storage_rank
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


    def expert_ops(self, slot: int, blocks: Blocks, layer: int, folds: Folds = ()) -> list[Op]:
        """The operations that write ``blocks``' expert tensors of ``layer`` into ``slot``: zero
        the slot's experts in that layer, copy, then multiply the B of a module of its own
        scaling by its ``folds`` ratio (none without routed experts). Each block's rank ``r``
        is its own (its shape's). Blocks of
        the fused form (module
        ``experts.gate_up_proj`` or ``experts.down_proj``): A ``[n, E * r, in]`` -- expert e's
        rows ``e r .. e r + r - 1`` -- and B ``[n, out, E * r]`` -- expert e's column j at
        ``j E + e`` (PEFT's ``ParamWrapper`` layout). Per-expert blocks (``experts.{e}.{proj}``):
        A ``[n, r, in]``, B ``[n, out, r]``."""
        row = self.expert_rows.get(layer)
        if row is None:  # a dense base, or a dense layer: no experts
            return []
        ops: list[Op] = [partial(_zero, t[row, slot]) for t in (
            self.expert_a_gate_up, self.expert_b_gate_up, self.expert_a_down, self.expert_b_down)]
        for first, module, ab, block in blocks:
            if not module.startswith("experts.") or not first <= layer < first + block.shape[0]:
                continue
            for target, source in self._expert_copies(row, slot, module,
                                                      per_expert(module), ab, block[layer - first]):
                ops.append(partial(_copy, target, source))
        for at, module, ratio in folds:
            if at == layer and module.startswith("experts."):
                ops.append(partial(_scale, self._expert_b_of(row, slot, module), ratio))
        return ops

    def _expert_b_of(self, row: int, slot: int, module: str) -> torch.Tensor:
        """The B storage of an expert module (either form) in one row and slot."""
        one = per_expert(module)
        if one is not None:
            return self.expert_b[one[1]][row, slot, one[0]]  # [out, R]
        if module == "experts.gate_up_proj":
            return self.expert_b_gate_up[row, slot]  # [E, 2 I, R]
        return self.expert_b_down[row, slot]  # [E, H, R]

    def _expert_copies(
        self, layer: int, slot: int, module: str, one: tuple[int, str] | None,
        ab: str, block: torch.Tensor,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(target, source) pairs of one layer's expert tensor (:meth:`expert_ops`); ``layer``
        is the layer's row of the expert storage."""
        if one is not None:  # A [r, in], B [out, r]
            expert, proj = one
            if ab == "A":
                return [(self.expert_a[proj][layer, slot, expert, : block.shape[0]], block)]
            return [(self.expert_b[proj][layer, slot, expert, :, : block.shape[1]], block)]
        e = self.expert_a_down.shape[2]
        gate_up = module == "experts.gate_up_proj"
        rank = block.shape[0 if ab == "A" else 1] // e  # A [E r, in], B [out, E r]
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

    def write(self, slot: int, adapter_id: str, rank: int, scaling: float,
              blocks: Blocks, folds: Folds = ()) -> None:
        """Copy an adapter into ``slot`` at once (:meth:`write_ops`, run in order)."""
        for op in self.write_ops(slot, adapter_id, rank, scaling, blocks, folds=folds):
            op()

    def copy_plan(self, slot: int, adapter_id: str, rank: int, scaling: float, blocks: Blocks,
                  piece_bytes: int = PIECE_BYTES, folds: Folds = ()) -> SlotCopy:
        """The copy of ``(first layer, module, "A"|"B"|"M", block)`` (``[n, r, in]`` for A,
        ``[n, out, r]`` for B, ``[n, out]`` for a DoRA magnitude, ``n`` consecutive layers,
        ``r`` at most ``rank``) into ``slot``, with the B of ``folds``' modules rescaled to
        the slot's ``scaling``: :class:`SlotCopy`."""
        info = SlotInfo(adapter_id, rank, scaling, frozenset(m for _, m, _, _ in blocks),
                        dora=any(ab == MAGNITUDE for _, _, ab, _ in blocks))
        vocab, vocab_ops = plan_parts(blocks, scaling, self._dtype, self._device, folds)
        return SlotCopy(self, slot, info, blocks, _covered(blocks), piece_bytes, vocab,
                        vocab_ops, folds)

    def write_ops(self, slot: int, adapter_id: str, rank: int, scaling: float, blocks: Blocks,
                  piece_bytes: int = PIECE_BYTES, folds: Folds = ()) -> list[Op]:
        """The whole copy's operations (:meth:`SlotCopy.whole`), to run in order on the load
        stream."""
        return self.copy_plan(slot, adapter_id, rank, scaling, blocks, piece_bytes,
                              folds).whole()

    def claim(self, slot: int, adapter_id: str) -> None:
        """Record ``slot`` as ``adapter_id``'s before its copy runs (the copy's last operation
        records its rank and scaling)."""
        self.table[slot] = SlotInfo(adapter_id)

    def clear(self, slot: int) -> None:
        """Forget the slot's adapter (its weights stay until the next write; its vocabulary
        modules go)."""
        self.table[slot] = SlotInfo()
        self.vocab.pop(slot, None)
