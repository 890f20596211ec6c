"""What one step runs (:class:`StepPlan`, the scheduler's answer) and the step's tensors it
turns into, all built on the host.

Nothing here reads a device tensor (docs/design.md rule 3): token ids, positions, cache slots, block
tables and LoRA slots come from the sequences' host-side state. With a :class:`StepStaging`
they are written into its preallocated (pinned) arena, which the engine flushes to the device
in one non-blocking copy; without one (tests), plain host tensors are made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lorastream.core.errors import LorastreamError
from lorastream.worker.device.step_arena import Arena, StepStaging
from lorastream.worker.engine.sequence import Sequence
from lorastream.worker.lora.backend import RowLora
from lorastream.worker.model.forward_batch import ForwardBatch, PrefillSpan
from lorastream.worker.model.kv_cache import BLOCK_SIZE


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk)
    failed: list[tuple[Sequence, LorastreamError]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def sequences(self) -> list[Sequence]:
        return self.decode + [seq for seq, _ in self.prefill]


@dataclass(frozen=True)
class StepInputs:
    batch: ForwardBatch  # device views into the arena (host tensors without staging)
    token_slots: list[RowLora]  # LoRA slot of every row (-1: base model), or its mix
    samplers: list[Sequence]  # the sequence of each logits row, in order
    logit_rows: list[int]  # the batch row of each logits row (batch.logit_rows, on the host)
    fed: list[tuple[Sequence, int]]  # tokens each sequence feeds this step
    arena: Arena | None  # where the LoRA metadata goes too; flushed by the engine


def _slots_of(blocks: list[int], start: int, count: int) -> list[int]:
    return [
        blocks[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(start, start + count)
    ]


def _decode_order(seq: Sequence) -> tuple[bool, int]:
    """By the LoRA slot of the row a decode step feeds, base-model rows last."""
    slot = seq.lora_slot(seq.num_computed)
    return slot < 0, slot


def build_step_inputs(
    plan: StepPlan, staging: StepStaging | None = None, extra: int = 0
) -> StepInputs:
    """``extra``: entries the caller will stage after these (the LoRA metadata)."""
    ids: list[int] = []
    positions: list[int] = []
    seq_lens: list[int] = []
    cache_slots: list[int] = []
    token_slots: list[RowLora] = []
    logit_rows: list[int] = []
    samplers: list[Sequence] = []
    fed: list[tuple[Sequence, int]] = []

    # Decode rows first: one token each, at position num_computed, ordered by LoRA slot with
    # base-model rows last, so that the LoRA layout usually is the batch itself (no gathers).
    tables: list[list[int]] = []
    contexts: list[int] = []
    decode = sorted(plan.decode, key=_decode_order)
    for seq in decode:
        pos = seq.num_computed
        ids.append(seq.token_at(pos))
        positions.append(pos)
        seq_lens.append(pos + 1)
        cache_slots.extend(_slots_of(seq.blocks, pos, 1))
        token_slots.append(seq.lora_row(pos))
        logit_rows.append(len(ids) - 1)
        samplers.append(seq)
        fed.append((seq, 1))
        tables.append(seq.blocks[: -(-(pos + 1) // BLOCK_SIZE)])
        contexts.append(pos + 1)
    width = max((len(t) for t in tables), default=0)
    padded_tables = [t + [0] * (width - len(t)) for t in tables]

    spans: list[tuple[int, int, int, list[int]]] = []  # start, length, context, table
    for seq, chunk in sorted(plan.prefill, key=lambda p: (p[0].slot < 0, p[0].slot)):
        start, begin = len(ids), seq.num_computed
        ids.extend(seq.prompt_ids[begin : begin + chunk])
        positions.extend(range(begin, begin + chunk))
        seq_lens.extend([begin + chunk] * chunk)
        cache_slots.extend(_slots_of(seq.blocks, begin, chunk))
        token_slots.extend(seq.lora_row(p) for p in range(begin, begin + chunk))
        context = begin + chunk
        spans.append((start, chunk, context, seq.blocks[: -(-context // BLOCK_SIZE)]))
        fed.append((seq, chunk))
        if context == len(seq.prompt_ids):  # the prompt is complete: sample the first token
            logit_rows.append(len(ids) - 1)
            samplers.append(seq)

    need = 4 * len(ids) + len(decode) * (width + 1) + len(logit_rows)
    need += sum(len(table) for *_, table in spans) + extra
    arena = staging.next(need) if staging is not None else None

    def longs(values: list[int]) -> torch.Tensor:
        return arena.longs(values) if arena is not None else torch.tensor(values, dtype=torch.long)

    def longs_2d(rows: list[list[int]]) -> torch.Tensor:
        if arena is not None:
            return arena.longs_2d(rows, width)
        return torch.tensor(rows, dtype=torch.long).view(len(rows), width)

    batch = ForwardBatch(
        input_ids=longs(ids),
        positions=longs(positions),
        seq_lens=longs(seq_lens),
        slot_mapping=longs(cache_slots),
        num_decode=len(decode),
        decode_block_tables=longs_2d(padded_tables),
        decode_context=longs(contexts),
        prefills=tuple(PrefillSpan(s, n, c, longs(t)) for s, n, c, t in spans),
        logit_rows=longs(logit_rows),
        max_position=max(positions, default=0),
        longest=max(seq_lens, default=0),
    )
    return StepInputs(batch, token_slots, samplers, logit_rows, fed, arena)
