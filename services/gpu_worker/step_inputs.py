"""Turn a :class:`StepPlan` into the step's tensors, all built on the host.

Nothing here reads a device tensor (DESIGN rule 3): token ids, positions, cache slots, block
tables and LoRA slots come from the sequences' host-side state, and the resulting
:class:`ForwardBatch` is moved to the device once, with non-blocking copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.gpu_worker.kv_cache import BLOCK_SIZE
from services.gpu_worker.model.forward_batch import ForwardBatch, PrefillSpan
from services.gpu_worker.scheduler import StepPlan
from services.gpu_worker.sequence import Sequence


@dataclass(frozen=True)
class StepInputs:
    batch: ForwardBatch  # on the host
    token_slots: list[int]  # LoRA slot of every row (-1: base model)
    samplers: list[Sequence]  # the sequence of each logits row, in order
    fed: list[tuple[Sequence, int]]  # tokens each sequence feeds this step


def _slots_of(blocks: list[int], start: int, count: int) -> list[int]:
    return [blocks[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(start, start + count)]


def build_step_inputs(plan: StepPlan) -> StepInputs:
    ids: list[int] = []
    positions: list[int] = []
    seq_lens: list[int] = []
    cache_slots: list[int] = []
    token_slots: list[int] = []
    logit_rows: list[int] = []
    samplers: list[Sequence] = []
    fed: list[tuple[Sequence, int]] = []

    # Decode rows first: one token each, at position num_computed, ordered by LoRA slot with
    # base-model rows last, so that the LoRA layout usually is the batch itself (no gathers).
    tables: list[list[int]] = []
    contexts: list[int] = []
    decode = sorted(plan.decode, key=lambda s: (s.slot < 0, s.slot))
    for seq in decode:
        pos = seq.num_computed
        ids.append(seq.token_at(pos))
        positions.append(pos)
        seq_lens.append(pos + 1)
        cache_slots.extend(_slots_of(seq.blocks, pos, 1))
        token_slots.append(seq.slot)
        logit_rows.append(len(ids) - 1)
        samplers.append(seq)
        fed.append((seq, 1))
        tables.append(seq.blocks[: -(-(pos + 1) // BLOCK_SIZE)])
        contexts.append(pos + 1)
    width = max((len(t) for t in tables), default=0)
    decode_tables = torch.tensor(
        [t + [0] * (width - len(t)) for t in tables], dtype=torch.long
    ).view(len(tables), width)

    spans: list[PrefillSpan] = []
    for seq, chunk in sorted(plan.prefill, key=lambda p: (p[0].slot < 0, p[0].slot)):
        start, begin = len(ids), seq.num_computed
        ids.extend(seq.prompt_ids[begin : begin + chunk])
        positions.extend(range(begin, begin + chunk))
        seq_lens.extend([begin + chunk] * chunk)
        cache_slots.extend(_slots_of(seq.blocks, begin, chunk))
        token_slots.extend([seq.slot] * chunk)
        context = begin + chunk
        table = torch.tensor(seq.blocks[: -(-context // BLOCK_SIZE)], dtype=torch.long)
        spans.append(PrefillSpan(start, chunk, context, table))
        fed.append((seq, chunk))
        if context == len(seq.prompt_ids):  # the prompt is complete: sample the first token
            logit_rows.append(len(ids) - 1)
            samplers.append(seq)

    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long),
        slot_mapping=torch.tensor(cache_slots, dtype=torch.long),
        num_decode=len(decode),
        decode_block_tables=decode_tables,
        decode_context=torch.tensor(contexts, dtype=torch.long),
        prefills=tuple(spans),
        logit_rows=torch.tensor(logit_rows, dtype=torch.long),
        max_position=max(positions, default=0),
        longest=max(seq_lens, default=0),
    )
    return StepInputs(batch, token_slots, samplers, fed)
