"""An adapter's vocabulary modules: new embedding rows, LoRA on ``embed_tokens`` and ``lm_head``,
and whole saved modules, applied per row of a mixed batch.

What PEFT computes, per kind (V the vocabulary, H the hidden size, ``es`` the family's embedding
scale, 1 where it has none; ``ids`` a row's token, ``h`` its final hidden state)::

    TrainableTokens   x = W'[ids] * es, W' = W with rows ``token_ids`` replaced by ``rows`` [k, H];
                      a tied lm_head computes with W' too: logits[:, token_ids] = h @ rowsᵀ
    LoRA embed_tokens x = W[ids] * es + (Aᵀ[ids] @ Bᵀ) * s * es      A [r, V], B [H, r]
    LoRA lm_head      logits = h @ Wᵀ + ((h @ Aᵀ) @ Bᵀ) * s           A [r, H], B [V, r]
    modules_to_save   x = E[ids] * es, logits = h @ Lᵀ                E, L [V, H], the adapter's

A saved ``base_layer.weight`` (PEFT saves the base embedding beside an embedding LoRA) is served
as that module's whole weight, as PEFT loads it. An untied lm_head never follows new embedding
rows, as in PEFT.

Storage: one :class:`VocabParts` per slot whose adapter has any, allocated when its copy is
planned and sized by the adapter's own tensors (not by the slot capacity): a plain-LoRA slot
costs nothing here. The slots' vocabulary bytes have a budget of their own (``--lora-vocab-bytes``,
:class:`VocabBudget`), since a saved module is a whole ``[V, H]`` matrix: at Qwen2.5-0.5B's
V 151,936 and H 896 in bf16 one saved ``embed_tokens`` is 272 MB, a rank-16 LoRA of all its
projections a few MB. The device tier evicts idle adapters by these bytes as it does by slots.

What a step costs: a step with no such row does no work here (:func:`build_vocab_step` gives
None). A step with some runs a few ops over the step's rows for the new token rows of all its
slots at once (:class:`VocabStep`), and per slot with a saved module or a vocabulary LoRA a few
ops on that slot's own rows only, grouped by slot on the host when the step is built (no
device read): a saved lm_head is read once and multiplied by its ``n_s`` logit rows
(``[n_s, H] x [H, V]``), an lm_head LoRA's B once by its rows' ``[n_s, r]``, both written into
those rows only (``index_copy_`` / ``index_add_``); a saved embedding or an embedding LoRA
likewise reads its rows' ids only. A slot none of whose rows the step computes logits of
(a prefill chunk before its prompt's end) reads none of its head. Base-model and plain-LoRA rows
keep their values exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from lorastream.core.adapter_format import FULL, TOKENS, VOCAB_MODULES, parse_vocab_key
from lorastream.core.manifest import AdapterManifest

TOKEN_IDS = "I"  # the block kind that carries TrainableTokens' token ids ([1, k] int64)

Op = Callable[[], None]
Blocks = list[tuple[int, str, str, torch.Tensor]]  # (first layer, module, kind, block [1, ...])


@dataclass
class VocabParts:
    """One slot's vocabulary tensors on the device (None: the adapter has no such part)."""

    scaling: float
    token_ids: torch.Tensor | None = None  # [k] int64
    token_rows: torch.Tensor | None = None  # [k, H]
    embed_a: torch.Tensor | None = None  # [r, V]
    embed_b: torch.Tensor | None = None  # [H, r]
    head_a: torch.Tensor | None = None  # [r, H]
    head_b: torch.Tensor | None = None  # [V, r]
    embed_full: torch.Tensor | None = None  # [V, H]
    head_full: torch.Tensor | None = None  # [V, H]

    @property
    def nbytes(self) -> int:
        tensors = (self.token_ids, self.token_rows, self.embed_a, self.embed_b, self.head_a,
                   self.head_b, self.embed_full, self.head_full)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass(frozen=True)
class VocabBudget:
    """The device bytes the slots' vocabulary modules may take, all slots together, and the
    bytes per element they are stored in (the slots' dtype)."""

    nbytes: int
    itemsize: int

    def need(self, manifest: AdapterManifest) -> int:
        """Bytes ``manifest``'s :class:`VocabParts` take on the device (0 for a plain LoRA): its
        vocabulary tensors in the slots' dtype, and its token ids as int64."""
        total = 0
        for info in manifest.tensors:
            if parse_vocab_key(info.name) is not None:
                count = 1
                for size in info.shape:
                    count *= size
                total += count * self.itemsize
        return total + len(manifest.token_indices) * 8


_FIELDS = {  # (module, kind) -> VocabParts field
    ("embed_tokens", TOKEN_IDS): "token_ids", ("embed_tokens", TOKENS): "token_rows",
    ("embed_tokens", "A"): "embed_a", ("embed_tokens", "B"): "embed_b",
    ("lm_head", "A"): "head_a", ("lm_head", "B"): "head_b",
    ("embed_tokens", FULL): "embed_full", ("lm_head", FULL): "head_full",
}


def vocab_blocks(blocks: Blocks) -> Blocks:
    """The blocks of the vocabulary modules."""
    return [b for b in blocks if b[1] in VOCAB_MODULES]


def plan_parts(
    blocks: Blocks, scaling: float, dtype: torch.dtype, device: torch.device,
    folds: tuple[tuple[int, str, float], ...] = (),
) -> tuple[VocabParts | None, list[Op]]:
    """Allocate a slot's :class:`VocabParts` for ``blocks`` and the copies that fill it (None
    and no copy when the adapter has no vocabulary part); a LoRA's B is multiplied by its
    module's ``folds`` ratio (its own scaling over ``scaling``: ``lora/slots.py``)."""
    mine = vocab_blocks(blocks)
    if not mine:
        return None, []
    ratios = {module: ratio for _, module, ratio in folds if module in VOCAB_MODULES}
    parts, ops = VocabParts(scaling), list[Op]()
    for _, module, kind, block in mine:
        source = block[0]
        target = torch.empty(source.shape, device=device,
                             dtype=torch.long if kind == TOKEN_IDS else dtype)
        setattr(parts, _FIELDS[(module, kind)], target)
        ops.append(partial(_copy, target, source))
        if kind == "B" and module in ratios:
            ops.append(partial(_scale, target, ratios[module]))
    return parts, ops


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    target.copy_(source, non_blocking=True)


def _scale(target: torch.Tensor, ratio: float) -> None:
    target.mul_(ratio)


class VocabStep:
    """The vocabulary part of one step: each vocabulary slot of the step and its rows.

    Each slot works on its own rows only, indexed by positions grouped on the host when the step
    is built: ``embed_rows`` its rows among the step's rows (slots with a saved embedding or an
    embedding LoRA), ``head_rows`` its positions among the step's logit rows (slots with a saved
    lm_head or an lm_head LoRA; None: built without the logit rows, the step computes no
    logits). Example: rows' slots [2, -1, 0, 2], logit rows [3, 0, 1], slot 2 with a saved
    lm_head -> head_rows {2: [0, 1]}; its head multiplies h rows 0 and 1 (batch rows 3 and 0)
    and writes logits rows 0 and 1, the others are left alone.

    New token rows run in a few ops for all slots at once: the step's slots' token ids and rows
    are concatenated (``flat_ids`` [F], ``flat_rows`` [F, H]) and each row names its slot's
    columns of them (``row_cols`` [T, k], k the most rows of a step's slot; a slot with fewer
    repeats its first column, a row without new rows names column 0 and has ``has_rows`` 0).
    Example, slot 2 with 3 token rows and slot 0 with 1, slot 0 first: row_cols of a slot-2 row
    [1, 2, 3], of a slot-0 row [0, 0, 0].
    """

    def __init__(self, parts: dict[int, VocabParts], tied: bool,
                 embed_rows: dict[int, torch.Tensor], head_rows: dict[int, torch.Tensor] | None,
                 num_logits: int = 0, row_cols: torch.Tensor | None = None,
                 has_rows: torch.Tensor | None = None) -> None:
        self.parts = parts
        self.tied = tied  # the base ties lm_head to embed_tokens: new rows reach the logits
        self.embed_rows = embed_rows  # slot -> [T_s] int64, its rows among the step's
        self.head_rows = head_rows  # slot -> [n_s] int64, its positions among the logit rows
        self.num_logits = num_logits  # n, the step's logit rows (with head_rows)
        self.row_cols = row_cols  # [T, k] int64; None: no slot of the step has new token rows
        self.has_rows = has_rows  # [T] int64, 1: the row's slot has new token rows
        tokens = [(p.token_ids, p.token_rows) for p in parts.values()
                  if p.token_ids is not None and p.token_rows is not None]
        self.flat_ids = torch.cat([i for i, _ in tokens]) if tokens else None  # [F]
        self.flat_rows = torch.cat([r for _, r in tokens]) if tokens else None  # [F, H]

    def embed(self, ids: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None
              ) -> torch.Tensor:  # ids [T], x [T, H] (scaled, updated in place) -> [T, H]
        """The rows' embeddings, each from its adapter's vocabulary modules.

        Semantics::

            for each slot s, rows R_s (embed_rows[s]):
                x[R_s] = E_s[ids[R_s]] * es                          (saved embed_tokens)
            x[t] = flat_rows[c] * es where ids[t] == flat_ids[c], c in row_cols[t]  (new rows)
            for each slot s: x[R_s] += (A_sᵀ[ids[R_s]] @ B_sᵀ) * scaling_s * es  (embedding LoRA)
        """
        for slot, rows in self.embed_rows.items():  # a row with a saved one has no new rows
            p = self.parts[slot]
            if p.embed_full is not None:
                x.index_copy_(0, rows, _scaled(p.embed_full[ids.index_select(0, rows)], scale))
        if self.row_cols is not None:
            assert self.has_rows is not None
            assert self.flat_ids is not None and self.flat_rows is not None
            cand = self.flat_ids[self.row_cols]  # [T, k]
            match = (ids.unsqueeze(1) == cand) & (self.has_rows.unsqueeze(1) != 0)  # [T, k]
            col = self.row_cols.gather(1, match.int().argmax(1, keepdim=True)).squeeze(1)  # [T]
            x = torch.where(match.any(1, keepdim=True), _scaled(self.flat_rows[col], scale), x)
        for slot, rows in self.embed_rows.items():
            p = self.parts[slot]
            if p.embed_a is not None and p.embed_b is not None:
                after_a = p.embed_a.t()[ids.index_select(0, rows)] * p.scaling  # [T_s, r]
                x.index_add_(0, rows, _scaled(after_a @ p.embed_b.t(), scale))  # [T_s, H]
        return x

    def head(self, h: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor
             ) -> torch.Tensor:  # h [n, H], logits [n, V] (updated in place), rows [n] -> [n, V]
        """The logits of batch rows ``rows`` (the ``logit_rows``), each from its adapter's head.

        Semantics::

            for each slot s, positions P_s (head_rows[s]):
                logits[P_s] = h[P_s] @ L_sᵀ                          (saved lm_head)
            logits[i, flat_ids[c]] = h[i] @ flat_rows[c], c in row_cols[rows[i]]  (tied new rows)
            for each slot s: logits[P_s] += ((h[P_s] @ A_sᵀ) * scaling_s) @ B_sᵀ  (lm_head LoRA)
        """
        if self.head_rows is None:
            if any(p.head_full is not None or p.head_a is not None for p in self.parts.values()):
                raise RuntimeError("this step's LoraStep was built without its logit rows")
            head_rows: dict[int, torch.Tensor] = {}
        else:
            assert h.shape[0] == self.num_logits, "the logit rows the step was built with"
            head_rows = self.head_rows
        for slot, pos in head_rows.items():
            p = self.parts[slot]
            if p.head_full is not None:
                logits.index_copy_(0, pos, h.index_select(0, pos) @ p.head_full.t())  # [n_s, V]
        if self.tied and self.row_cols is not None:
            assert self.has_rows is not None
            assert self.flat_ids is not None and self.flat_rows is not None
            cols = self.row_cols[rows]  # [n, k] columns of the flat rows
            new = (h @ self.flat_rows.t()).gather(1, cols)  # [n, k]
            vocab = self.flat_ids[cols]  # [n, k] their token ids
            has = self.has_rows[rows].unsqueeze(1) != 0  # [n, 1]
            logits.scatter_(1, vocab, torch.where(has, new, logits.gather(1, vocab)))
        for slot, pos in head_rows.items():
            p = self.parts[slot]
            if p.head_a is not None and p.head_b is not None:
                after_a = (h.index_select(0, pos) @ p.head_a.t()) * p.scaling  # [n_s, r]
                logits.index_add_(0, pos, after_a @ p.head_b.t())  # [n_s, V]
        return logits


def _scaled(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return x if scale is None else x * scale


def build_vocab_step(
    token_slots: list[int], logit_rows: Sequence[int] | None, parts: dict[int, VocabParts],
    tied: bool, longs: Callable[[list[int]], torch.Tensor],
) -> VocabStep | None:
    """The step's :class:`VocabStep`, its row indices grouped by slot on the host and staged by
    ``longs`` (``len(token_slots)`` times :func:`token_width` plus 1, plus ``len(token_slots)``
    and ``len(logit_rows)``, entries at most); ``logit_rows``: the batch rows the step computes
    logits of (None: none). None when no row's slot has vocabulary parts."""
    present = {s: parts[s] for s in sorted(set(token_slots)) if s in parts}
    if not present:
        return None
    embedding = {s for s, p in present.items() if p.embed_full is not None or p.embed_a is not None}
    heads = {s for s, p in present.items() if p.head_full is not None or p.head_a is not None}
    embed_rows = {s: longs(r) for s, r in _by_slot(token_slots, embedding).items()}
    head_rows = None if logit_rows is None else {
        s: longs(r) for s, r in _by_slot([token_slots[r] for r in logit_rows], heads).items()}
    num_logits = 0 if logit_rows is None else len(logit_rows)
    first: dict[int, tuple[int, int]] = {}  # slot -> (its first flat column, its token rows)
    total = 0
    for slot, p in present.items():
        if p.token_rows is not None and p.token_ids is not None:
            first[slot] = (total, p.token_ids.shape[0])
            total += p.token_ids.shape[0]
    if not first:
        return VocabStep(present, tied, embed_rows, head_rows, num_logits)
    width = max(k for _, k in first.values())
    cols: list[int] = []
    for slot in token_slots:
        start, k = first.get(slot, (0, 1))
        cols.extend([*range(start, start + k), *[start] * (width - k)])
    has = longs([int(s in first) for s in token_slots])  # read after the arena's flush
    return VocabStep(present, tied, embed_rows, head_rows, num_logits,
                     longs(cols).view(len(token_slots), width), has)


def _by_slot(row_slots: list[int], wanted: set[int]) -> dict[int, list[int]]:
    """The positions in ``row_slots`` of each slot of ``wanted`` that occurs there, in order."""
    rows: dict[int, list[int]] = {}
    if wanted:
        for i, slot in enumerate(row_slots):
            if slot in wanted:
                rows.setdefault(slot, []).append(i)
    return rows


def token_width(parts: dict[int, VocabParts]) -> int:
    """The most new token rows of any slot (0: none has any)."""
    return max((p.token_ids.shape[0] for p in parts.values() if p.token_ids is not None),
               default=0)
