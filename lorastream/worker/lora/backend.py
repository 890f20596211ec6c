"""The LoRA delta for every token of a mixed batch in a few batched ops.

A backend turns the step's per-token slot indices into metadata once (:meth:`prepare`, on the
host, reused by every layer and module), then adds ``scaling * (x @ Aᵀ) @ Bᵀ`` into each
projection's output (:meth:`add`).

The torch backend has two layouts and picks one per step (host-side, from the token counts):

* **slot-major bmm** (decode-like steps): tokens are laid out ``[S_range, m, K]`` -- each slot
  of the active range ``lo .. lo+S_range-1`` (lowest to highest slot with tokens) gets ``m`` rows
  (its tokens, then padding) -- and two ``bmm`` calls read every adapter's weights once,
  straight from slot storage (no weight copy; slots are handed out lowest-first, so the active
  ones form a short range, and a step that uses one slot reads that slot alone, wherever it
  is). Example, slots of 5 tokens [2, -1, 0, 2, 0] -> lo 0, S_range 3, m 2::

      slot 0: rows [2, 4]   slot 1: [pad, pad]   slot 2: [0, 3]      (row 1 has no adapter)
      layout_rows = [2, 4, 0, 0, 0, 3]    output_rows = [4, 0, 0, 5, 1]    row_scale[1] = 0

* **grouped GEMM** (prefill-heavy steps, where one slot may own hundreds of tokens and padding
  would waste most of the work): rows sorted by slot and ``grouped_mm`` with per-slot group
  ends (Punica's SGMV semantics).

Slot-major is chosen when its padded rows are at most twice the real ones. On a CPU it runs at
memory bandwidth, where ``grouped_mm`` pays per group for one token per adapter. Cost follows the
largest rank in the batch (ranks are sliced to it), not the slot capacity.

With ``native`` (``--cpu-kernels``, fp32 on the CPU), a slot-major step whose batch rows are its
layout (decode: the step builder orders decode rows by slot) runs
``lorastream/kernels/cpu/lora.py``'s ``lora_rows`` instead: one C++ op per input that reads each
row's A and B once and adds the delta into the output in place (same sums, another order), where
the bmm path runs 18 ops per layer.

**Weighted mixes** (``core/adapter_mix.py``): a row may take several slots with a weight each,
``delta = sum_i w_i * scaling_i * B_i A_i x`` (PEFT's ``add_weighted_adapter`` with
``combination_type="cat"``), from each component's own slot. Such a step is laid out over
*entries* (:class:`MixEntries`), one per (row, slot) pair -- a plain row is one entry of weight
1, a k-adapter mix row k entries -- with the layouts above built over entries instead of rows,
and the deltas added back with a scatter-add (``index_add_``) into their rows. Only steps that
hold a mix row take that path (no identity layout); every other step keeps its own. With
``native``, a slot-major mix step runs ``lora_rows`` over its entry layout (x gathered into it,
the deltas into a zeroed block) and adds that block into the rows with one ``index_add_``.
Example, rows [2, mix((0, 0.7), (2, 0.3)), -1]::

    entries: rows [0, 1, 1]   slots [2, 0, 2]   scale [s2, 0.7 s0, 0.3 s2]
    slot-major: slot 0: entry 1; slot 2: entries 0, 2 -> per_slot 2, layout over entries

DoRA slots (``slots.py``) take one more step per adapted projection, after the delta: each row's
output columns are multiplied by its slot's factor taken at placement (and shifted where the
projection has a bias), ``out = f * (W x + s B A x) + (1 - f) * bias`` -- the identity entry
(``f = 1``, shift 0) for every other row, so base-model and plain-LoRA rows keep their values
exactly. It runs only in steps with a DoRA row, and only on the projections DoRA slots adapt
(:class:`DoraRows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F

from lorastream.kernels.cpu.lora import lora_rows
from lorastream.worker.device.step_arena import Arena
from lorastream.worker.lora.experts import (
    ExpertStepMeta,
    add_expert_lora,
    add_expert_lora_rows,
    build_expert_meta,
    few_per_group,
)
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.lora.vocab import VocabStep, build_vocab_step

PADDING_LIMIT = 2.0  # slot-major when padded rows <= PADDING_LIMIT x real rows
# A step gathers each DoRA module's row factors for every layer at once (one op per module, not
# per layer) while they take at most this many bytes; above (long prefills), layer by layer.
DORA_GATHER_BYTES = 4 << 20


Mix = tuple[tuple[int, float], ...]  # a mix row's (slot, weight) per component
RowLora = int | Mix  # what a batch row takes: a slot (-1: base model) or a mix


@dataclass(frozen=True)
class MixEntries:
    """The (row, slot, weight) entries of a step that holds a mix row (module docstring)."""

    rows: list[int]  # [E] batch row of each entry
    slots: list[int]  # [E]
    weights: list[float]  # [E] the mix weight (1.0 for a plain row)


def split_mixes(row_lora: Sequence[RowLora]) -> tuple[list[int], MixEntries | None]:
    """Per-row slots with every mix row as -1 (what DoRA, vocabulary and expert metadata read:
    a mix has none of them), and the step's entries; None when no row is a mix."""
    plain = [r if isinstance(r, int) else -1 for r in row_lora]
    if all(isinstance(r, int) for r in row_lora):
        return plain, None
    rows: list[int] = []
    slots: list[int] = []
    weights: list[float] = []
    for row, lora in enumerate(row_lora):
        for slot, weight in ((lora, 1.0),) if isinstance(lora, int) else lora:
            if slot >= 0:
                rows.append(row)
                slots.append(slot)
                weights.append(weight)
    return plain, MixEntries(rows, slots, weights)


@dataclass(frozen=True)
class DoraRows:
    """The DoRA part of a step's metadata (None in a step with no DoRA row).

    Example: slots of 4 rows [2, -1, 0, 2], slot 2 DoRA, 3 slots -> row_slot [2, 3, 3, 2]
    (3: the identity entry, for the base-model row and slot 0's plain LoRA)."""

    modules: frozenset[str]  # modules some DoRA slot of the step adapts
    row_slot: torch.Tensor  # [T] long: the dora_scale entry of each row


def build_dora_rows(
    token_slots: list[int], slots: LoraSlots, longs: Callable[[list[int]], torch.Tensor]
) -> DoraRows | None:
    """:class:`DoraRows` of a step, its index staged by ``longs``; None without a DoRA row."""
    table = slots.table
    dora = {s for s in token_slots if s >= 0 and table[s].dora}
    if not dora:
        return None
    return DoraRows(
        modules=frozenset().union(*(table[s].modules for s in dora)),
        row_slot=longs([s if s in dora else slots.identity for s in token_slots]),
    )


@dataclass(frozen=True)
class LoraStepMeta:
    """Per-step metadata, built on the host and moved to the device once.

    The delta is computed in a *layout* (slot-major ``[S_range, m]`` or rows sorted by slot),
    then gathered back to batch rows as one contiguous ``[T, N]`` block and added with a
    per-row scale that is 0 for base-model rows. When the batch rows already are the layout
    (rows ordered by slot, as the step builder orders decode rows), both gathers are skipped.
    """

    max_rank: int
    modules: frozenset[str]  # modules some active adapter adapts
    row_scale: torch.Tensor  # [T, 1] scaling of each batch row, 0 for base-model rows
    layout_rows: torch.Tensor | None  # [P] x row feeding each layout row (padding: row 0)
    output_rows: torch.Tensor | None  # [T] layout row of each batch row (base rows: 0)
    # slot-major layout: slots slot_lo .. slot_lo + slot_range - 1, per_slot rows each
    slot_lo: int = 0
    slot_range: int = 0
    per_slot: int = 0
    # grouped layout
    offs: torch.Tensor | None = None  # [S] int32, cumulative group ends
    sorted_slots: torch.Tensor | None = None  # [P] int64 (fallback gather path)
    dora: DoraRows | None = None  # the DoRA rows of the step, None if none
    entry_rows: torch.Tensor | None = None  # [E] batch row of each entry; None without a mix
    # a slot-major mix step: each layout row's entry scale (padding: 0); its batch row, where
    # its delta goes, is its layout_rows entry
    layout_scale: torch.Tensor | None = None  # [P] fp32

    @property
    def slot_major(self) -> bool:
        return self.offs is None

    @property
    def rows_are_layout(self) -> bool:
        """Slot-major with the batch rows as its layout: no gather in, none out."""
        return self.offs is None and self.output_rows is None


MetaT = TypeVar("MetaT")  # a backend's per-step metadata: LoraStepMeta, or Triton's own


class LoraBackend(Protocol[MetaT]):
    name: str

    def prepare(
        self, token_slots: list[int], slots: LoraSlots, arena: Arena | None = None,
        mixes: MixEntries | None = None,
    ) -> MetaT | None:
        """Metadata for rows whose slot is ``token_slots[row]`` (-1: base model), staged in
        ``arena`` when given (the engine flushes it), else as plain tensors. ``mixes``: the
        step's entries when a row is a mix (those rows are -1 in ``token_slots``)."""

    def add(
        self,
        x: torch.Tensor,  # [T, K]
        a: torch.Tensor,  # [S, R, K]
        b: torch.Tensor,  # [S, N, R]
        out: torch.Tensor,  # [T, N_total]
        col: int,
        meta: MetaT,
    ) -> None:
        """out[:, col:col+N] += scaling[s] * (x @ a[s, :r]ᵀ) @ b[s, :, :r]ᵀ per row."""

    def add_experts(
        self,
        x: torch.Tensor,  # [P, K]: a MoE layer's expert-sorted assignments
        token: torch.Tensor,  # [P]
        expert: torch.Tensor,  # [P]
        a: torch.Tensor,  # [S, E, G * R, K]
        bs: list[torch.Tensor],  # G x [S, E, N_g, R]
        out: torch.Tensor,  # [P, sum N_g]
        meta: ExpertStepMeta,
    ) -> None:
        """out[p] += scaling * (B[s, e] @ (A[s, e] @ x[p])) per assignment (``lora/experts.py``)."""


def staged_size(num_rows: int, num_slots: int, token_width: int = 0) -> int:
    """The most arena entries :func:`build_meta` (and ``build_expert_meta``: 2 per row and 1
    per slot; ``build_vocab_step``: ``token_width + 3`` per row, ``token_width`` the slots' most
    new token rows) stage for ``num_rows`` rows (entries, in a step with a mix row)."""
    return (int(PADDING_LIMIT * num_rows) + (9 + token_width) * num_rows + 2 * num_slots
            + 8)


def build_meta(
    token_slots: list[int],
    slots: LoraSlots,
    dtype: torch.dtype,
    device: torch.device,
    arena: Arena | None = None,
    mixes: MixEntries | None = None,
) -> LoraStepMeta | None:
    """Group units (rows, or ``mixes``' entries) by slot on the host and choose the layout;
    None when no row has an adapter."""
    unit_slots = token_slots if mixes is None else mixes.slots
    row_of = (lambda u: u) if mixes is None else mixes.rows.__getitem__  # unit -> its x row
    by_slot: dict[int, list[int]] = {}
    for unit, slot in enumerate(unit_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(unit)
    if not by_slot:
        return None
    table = slots.table
    active = sorted(by_slot)
    num_units = sum(len(v) for v in by_slot.values())
    lo = active[0]
    slot_range = active[-1] - lo + 1
    per_slot = max(len(v) for v in by_slot.values())
    slot_major = slot_range * per_slot <= PADDING_LIMIT * num_units
    output_rows = [0] * len(unit_slots)
    scale = [table[s].scaling if s >= 0 else 0.0 for s in unit_slots]
    if mixes is not None:
        scale = [s * w for s, w in zip(scale, mixes.weights, strict=True)]
    layout_scale: list[float] | None = None
    if slot_major:  # layout row of (slot, j) is (slot - lo) * per_slot + j; padding reads row 0
        size = slot_range * per_slot
        layout_rows = [0] * size
        if mixes is not None:
            layout_scale = [0.0] * size
        for slot in active:
            for j, unit in enumerate(by_slot[slot]):
                layout_rows[(slot - lo) * per_slot + j] = row_of(unit)
                output_rows[unit] = (slot - lo) * per_slot + j
                if layout_scale is not None:
                    layout_scale[(slot - lo) * per_slot + j] = scale[unit]
    else:  # units sorted by slot
        size = num_units
        units = [unit for slot in active for unit in by_slot[slot]]
        layout_rows = [row_of(unit) for unit in units]
        for i, unit in enumerate(units):
            output_rows[unit] = i
    # Identity: the batch rows *are* the layout (rows 0..size-1 in layout order, nothing padded).
    identity = (mixes is None and size == len(token_slots)
                and layout_rows == list(range(size)))
    def longs(values: list[int]) -> torch.Tensor:
        if arena is not None:
            return arena.longs(values)
        return torch.tensor(values, dtype=torch.long).to(device)

    def floats(values: list[float]) -> torch.Tensor:
        return arena.floats(values) if arena is not None else torch.tensor(values).to(device)

    row_scale = (
        arena.floats(scale) if arena is not None else torch.tensor(scale).to(device)
    ).to(dtype).unsqueeze(1)  # [U, 1]; the cast runs on the device after the flush
    common = LoraStepMeta(
        max_rank=max(table[s].rank for s in active),
        modules=frozenset().union(*(table[s].modules for s in active)),
        row_scale=row_scale,
        layout_rows=None if identity else longs(layout_rows),
        output_rows=None if identity else longs(output_rows),
        dora=build_dora_rows(token_slots, slots, longs),
        entry_rows=None if mixes is None else longs(mixes.rows),
        layout_scale=None if layout_scale is None else floats(layout_scale).to(dtype),
    )
    if slot_major:
        return replace(common, slot_lo=lo, slot_range=slot_range, per_slot=per_slot)
    ends, total = [], 0
    for slot in range(slots.num_slots):
        total += len(by_slot.get(slot, ()))
        ends.append(total)
    return replace(
        common,
        offs=longs(ends).to(torch.int32),
        sorted_slots=longs([s for s in active for _ in by_slot[s]]),
    )


def _in_layout(x: torch.Tensor, meta: LoraStepMeta) -> torch.Tensor:
    """x [T, K] as the step's layout rows [P, K] (x itself when the batch rows are the layout)."""
    return x if meta.layout_rows is None else x.index_select(0, meta.layout_rows)


def _grouped_ok(t: torch.Tensor) -> bool:
    """grouped_mm needs every non-unit stride to be a multiple of 16 bytes."""
    size = t.element_size()
    dims = zip(t.stride(), t.shape, strict=True)
    return all(st * size % 16 == 0 for st, n in dims if st != 1 and n > 1)


def _native_mix(
    x: torch.Tensor,  # [T, K]
    a: torch.Tensor,  # [S, G * R, K]
    bs: list[torch.Tensor],  # G x [S, N_g, R]
    out: torch.Tensor,  # [T, N_total]
    cols: list[int],
    meta: LoraStepMeta,
) -> None:
    """A slot-major mix step's deltas with the C++ ``lora_rows``: run over the step's entry
    layout (x gathered into it), into a zeroed block of the G projections' columns, then added
    into each entry's batch row with one ``index_add_`` (a mix row takes several).

    Semantics::

        y[p] = layout_scale[p] * B[slot(p)] A[slot(p)] x[layout_rows[p]]    (padding: 0)
        out[layout_rows[p], cols] += y[p]
    """
    assert meta.layout_rows is not None and meta.layout_scale is not None
    lo = min(cols)
    hi = max(c + b.shape[1] for c, b in zip(cols, bs, strict=True))
    xs = x.index_select(0, meta.layout_rows)  # [P, K]
    y = out.new_zeros(xs.shape[0], hi - lo)  # [P, N]
    lora_rows(xs, a, bs, [c - lo for c in cols], meta.layout_scale, meta.slot_lo,
              meta.per_slot, meta.max_rank, y)
    out[:, lo:hi].index_add_(0, meta.layout_rows, y)


class TorchLoraBackend:
    """Slot-major bmm or grouped GEMM, chosen per step (see the module docstring)."""

    name = "torch"

    def __init__(self, dtype: torch.dtype, device: torch.device, native: bool = False) -> None:
        """``native``: the C++ ``lora_rows`` where a step allows (module docstring); the caller
        has loaded the CPU ops (``device/cpu/kernel_choice.py``) and the model is fp32 on the
        CPU."""
        self._dtype = dtype
        self._device = device
        self.native = native

    def prepare(
        self, token_slots: list[int], slots: LoraSlots, arena: Arena | None = None,
        mixes: MixEntries | None = None,
    ) -> LoraStepMeta | None:
        return build_meta(token_slots, slots, self._dtype, self._device, arena, mixes)

    def add(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        col: int,
        meta: LoraStepMeta,
    ) -> None:
        if self.native and meta.rows_are_layout:
            lora_rows(x.contiguous(), a, [b], [col], meta.row_scale.view(-1), meta.slot_lo,
                      meta.per_slot, meta.max_rank, out)
            return
        if self.native and meta.layout_scale is not None:
            _native_mix(x, a, [b], out, [col], meta)
            return
        r, n = meta.max_rank, b.shape[1]
        xs = _in_layout(x, meta)  # [P, K]
        if meta.slot_major:
            lo, s, m = meta.slot_lo, meta.slot_range, meta.per_slot
            h = torch.bmm(xs.view(s, m, -1), a[lo : lo + s, :r].transpose(1, 2))  # [S_range, m, r]
            y = torch.bmm(h, b[lo : lo + s, :, :r].transpose(1, 2)).view(s * m, n)  # [P, N]
        else:
            assert meta.offs is not None and meta.sorted_slots is not None
            a_t = a[:, :r].transpose(1, 2)  # [S, K, r]
            b_t = b[:, :, :r].transpose(1, 2)  # [S, r, N]
            if _grouped_ok(xs) and _grouped_ok(a_t) and _grouped_ok(b_t):
                h = F.grouped_mm(xs, a_t, offs=meta.offs)  # [P, r]
                y = F.grouped_mm(h, b_t, offs=meta.offs)  # [P, N]
            else:  # strides grouped_mm cannot take: gather the weights per row
                h = torch.bmm(xs.unsqueeze(1), a_t[meta.sorted_slots])  # [P, 1, r]
                y = torch.bmm(h, b_t[meta.sorted_slots]).squeeze(1)  # [P, N]
        self._accumulate(y, out, col, meta)

    def add_group(
        self,
        x: torch.Tensor,  # [T, K]
        a: torch.Tensor,  # [S, G * R, K]: the A of G projections that read x
        bs: list[torch.Tensor],  # G x [S, N_g, R]
        out: torch.Tensor,  # [T, N_total]
        cols: list[int],
        meta: LoraStepMeta,
    ) -> bool:
        """The deltas of G projections of the same input, shrunk in ONE matmul; False (nothing
        done) unless the step is slot-major and its largest rank fills the slots' rank R."""
        rank = a.shape[1] // len(bs)
        if self.native and meta.rows_are_layout:  # any rank up to the slots'
            lora_rows(x.contiguous(), a, bs, cols, meta.row_scale.view(-1), meta.slot_lo,
                      meta.per_slot, meta.max_rank, out)
            return True
        if self.native and meta.layout_scale is not None:  # a slot-major mix step
            _native_mix(x, a, bs, out, cols, meta)
            return True
        if not meta.slot_major or meta.max_rank != rank:
            return False
        lo, s, m = meta.slot_lo, meta.slot_range, meta.per_slot
        xs = _in_layout(x, meta)  # [P, K]
        h = torch.bmm(xs.view(s, m, -1), a[lo : lo + s].transpose(1, 2))  # [S_range, m, G * R]
        for g, (b, col) in enumerate(zip(bs, cols, strict=True)):
            n = b.shape[1]
            part = h[:, :, g * rank : (g + 1) * rank]  # [S_range, m, R]
            y = torch.bmm(part, b[lo : lo + s].transpose(1, 2)).view(s * m, n)  # [P, N_g]
            self._accumulate(y, out, col, meta)
        return True

    def add_experts(
        self, x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, a: torch.Tensor,
        bs: list[torch.Tensor], out: torch.Tensor, meta: ExpertStepMeta,
    ) -> None:
        """Grouped GEMMs over (slot, expert) segments (``add_expert_lora``), or with
        ``native`` in decode-like steps the C++ row op (``add_expert_lora_rows``)."""
        top_k = x.shape[0] // meta.row_slots.shape[0]
        if self.native and few_per_group(meta, top_k, a.shape[1]):
            add_expert_lora_rows(x, token, expert, a, bs, out, meta)
            return
        add_expert_lora(x, token, expert, a, bs, out, top_k, meta)

    @staticmethod
    def _accumulate(y: torch.Tensor, out: torch.Tensor, col: int, meta: LoraStepMeta) -> None:
        """out[:, col:col+N] += row_scale * y, y [P, N] back in unit order; with mixes, each
        entry's scaled delta is added into its row (several entries per mix row).

        Semantics::

            for u in units:   out[row(u), col:col+N] += row_scale[u] * y[output_rows[u]]
        """
        delta = y if meta.output_rows is None else y.index_select(0, meta.output_rows)  # [U, N]
        view = out[:, col : col + y.shape[1]]  # [T, N]
        if meta.entry_rows is None:
            view.addcmul_(delta, meta.row_scale)
        else:
            view.index_add_(0, meta.entry_rows, delta * meta.row_scale)


class LoraStep:
    """The model's LoRA hook for one step: slots + backend + this step's metadata (and, on a
    MoE base with expert adapters in the step, the expert deltas' metadata)."""

    def __init__(
        self, slots: LoraSlots, backend: LoraBackend, meta: LoraStepMeta,
        experts: ExpertStepMeta | None = None, vocab: VocabStep | None = None,
    ) -> None:
        """``meta``: the backend's (every backend's metadata has ``modules`` and ``dora``);
        ``experts``: the step's expert-LoRA metadata (MoE bases), None without; ``vocab``: its
        rows' vocabulary modules (``lora/vocab.py``), None when no row's adapter has any."""
        self._slots = slots
        self._backend = backend
        self._meta = meta
        self._experts = experts
        self._vocab = vocab
        self._dora = meta.dora
        # module -> (dora_scale, dora_shift or None) of the step's rows, [L, T, N] (see
        # DORA_GATHER_BYTES), gathered at the module's first layer
        self._dora_rows: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    @classmethod
    def for_step(
        cls, slots: LoraSlots, backend: LoraBackend, row_lora: Sequence[RowLora],
        dtype: torch.dtype, device: torch.device, arena: Arena | None = None,
        logit_rows: Sequence[int] | None = None,
    ) -> LoraStep | None:
        """The hook of a step whose rows take ``row_lora`` (a slot, -1 for the base model, or
        a mix); None when no row has an adapter. Metadata staged in ``arena`` when given.
        ``logit_rows``: the batch rows the step computes logits of, on the host (the
        vocabulary modules' head works on each slot's own; None: the step computes none)."""
        token_slots, mixes = split_mixes(row_lora)
        meta = backend.prepare(token_slots, slots, arena, mixes)
        if meta is None:
            return None

        def longs(values: list[int]) -> torch.Tensor:
            if arena is not None:
                return arena.longs(values)
            return torch.tensor(values, dtype=torch.long).to(device)

        return cls(slots, backend, meta,
                   build_expert_meta(token_slots, slots, dtype, device, arena),
                   build_vocab_step(token_slots, logit_rows, slots.vocab, slots.tied, longs))

    def embed(self, ids: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None
              ) -> torch.Tensor:  # ids [T], x [T, H] -> [T, H]
        """The rows' embeddings, each from its adapter's vocabulary modules where it has any."""
        return x if self._vocab is None else self._vocab.embed(ids, x, scale)

    def head(self, h: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The logits of batch rows ``rows`` (h [n, H], logits [n, V]) from each one's head."""
        return logits if self._vocab is None else self._vocab.head(h, logits, rows)

    def add_experts(
        self, layer: int, part: str, x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """A MoE layer's expert deltas for the expert-sorted rows (``lora/experts.py``)."""
        meta = self._experts
        if meta is None:
            return
        slots = self._slots
        row = slots.expert_rows[layer]  # sparse layers only hold expert storage
        if part == "gate_up":
            a, bs = slots.expert_a_gate_up[row], [slots.expert_b["gate_proj"][row],
                                                  slots.expert_b["up_proj"][row]]
        else:
            a, bs = slots.expert_a_down[row], [slots.expert_b_down[row]]
        self._backend.add_experts(x, token, expert, a, bs, out, meta)

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor, col: int) -> None:
        if module in self._meta.modules:
            self._backend.add(
                x, self._slots.a[module][layer], self._slots.b[module][layer], out, col, self._meta
            )
            self._rescale_dora(layer, module, out, col)

    def _rescale_dora(self, layer: int, module: str, out: torch.Tensor, col: int) -> None:
        """DoRA rows' output columns of ``module``, the delta already in, times their slot's
        factor, plus their shift (module docstring).

        Semantics::

            e = dora.row_slot[t]            # the row's slot if DoRA, else the identity entry
            out[t, col:col+N] = out[t, col:col+N] * dora_scale[module][layer, e]
                                + dora_shift[module][layer, e]   (projections with a bias)
        """
        dora = self._dora
        if dora is None or module not in dora.modules:
            return
        scale = self._slots.dora_scale[module]  # [L, S + 1, N]
        shift = self._slots.dora_shift.get(module)
        view = out[:, col : col + scale.shape[2]]  # [T, N]
        rows = self._dora_rows.get(module)
        if rows is None and scale[:, 0].numel() * view.shape[0] * 4 <= DORA_GATHER_BYTES:
            rows = self._dora_rows[module] = (  # [L, T, N] each
                scale.index_select(1, dora.row_slot),
                None if shift is None else shift.index_select(1, dora.row_slot),
            )
        if rows is not None:
            view.mul_(rows[0][layer])
            if rows[1] is not None:
                view.add_(rows[1][layer])
            return
        view.mul_(scale[layer].index_select(0, dora.row_slot))
        if shift is not None:
            view.add_(shift[layer].index_select(0, dora.row_slot))

    def add_group(
        self, layer: int, modules: tuple[str, ...], x: torch.Tensor, out: torch.Tensor,
        cols: tuple[int, ...],
    ) -> None:
        """:meth:`add` for projections that read the same ``x`` (q/k/v, gate/up): one shrink
        for all of them when the backend can and every one of them is adapted in this step."""
        fused = getattr(self._backend, "add_group", None)
        group = self._slots.a_groups.get(modules)
        if (
            fused is not None and group is not None and self._meta.modules.issuperset(modules)
            and fused(x, group[layer], [self._slots.b[m][layer] for m in modules], out,
                      list(cols), self._meta)
        ):
            for module, col in zip(modules, cols, strict=True):
                self._rescale_dora(layer, module, out, col)
            return
        for module, col in zip(modules, cols, strict=True):
            self.add(layer, module, x, out, col)
