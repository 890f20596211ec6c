"""Which teacher-forced positions of ``bench engine --quantization`` are decisive: the reference
logits there, from HF transformers + PEFT in fp32 over the fp32 engine's own sequences; and the
same reference over a mode's dequantized weights (:func:`dequantized_base`), the comparison the
token goal is stated against.

A position is decisive for a mode when the reference's top-2 margin exceeds the mode's stated
logit tolerance (``LOGIT_TOLERANCE[mode] * max |logit|`` of that row,
``lorastream/worker/model/quant_linear.py``): an error the tolerance allows cannot flip its
argmax. Within it the position is a near-tie, and either token is as good an answer as the
tolerance can promise. The same criterion is the tolerance test's
(``tests/worker/model/test_quantization.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lorastream.bench.peft_peer import MixedPeft

GROUP = 8  # sequences per forward: bounds the [B, S, V] logits held at once


@dataclass(frozen=True)
class ReferenceRows:
    """Per teacher-forced case, in the order given: the reference logits' top-2 margin, their
    largest magnitude, and their argmax."""

    margin: torch.Tensor  # [C] float32
    scale: torch.Tensor  # [C] float32, max |logit| of the row
    argmax: torch.Tensor  # [C] int64

    def decisive(self, tolerance: float) -> torch.Tensor:  # [C] bool
        return self.margin > tolerance * self.scale


def reference_rows(
    peft: MixedPeft, prompts: list[tuple[int, ...]], adapter_of: list[str],
    tokens: dict[int, list[int]], cases: list[tuple[int, int]],
) -> ReferenceRows:
    """Teacher-forced reference logits at ``cases`` ((sequence, position) pairs): sequence ``i``
    is ``prompts[i] + tokens[i]`` under adapter ``adapter_of[i]`` (one of ``peft``'s ``a<j>``,
    or ``base``), and position ``k``'s row is the one that predicts ``tokens[i][k]``. One
    left-padded forward per group of sequences, mixed-adapter (``adapter_names=``)."""
    from lorastream.bench.peft_peer import left_padded

    model, pad = peft.model, peft.pad
    wanted: dict[int, list[int]] = {}
    for i, k in cases:
        wanted.setdefault(i, []).append(k)
    found: dict[tuple[int, int], tuple[float, float, int]] = {}
    sequences = sorted(wanted)
    for start in range(0, len(sequences), GROUP):
        group = sequences[start : start + GROUP]
        full = [list(prompts[i]) + tokens[i] for i in group]
        input_ids, mask = left_padded(full, pad)  # [B, S]
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, S]: left padding shifts none
        names = ["__base__" if adapter_of[i] == "base" else adapter_of[i] for i in group]
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                           adapter_names=names).logits.float()  # [B, S, V]
        width = input_ids.shape[1]
        for b, i in enumerate(group):
            offset = width - len(full[b]) + len(prompts[i]) - 1  # the row predicting token 0
            for k in wanted[i]:
                row = logits[b, offset + k]  # [V]
                top2 = row.topk(2).values  # [2]
                found[(i, k)] = (float(top2[0] - top2[1]), float(row.abs().max()),
                                 int(row.argmax()))
    margin, scale, argmax = zip(*(found[case] for case in cases), strict=True)
    return ReferenceRows(torch.tensor(margin), torch.tensor(scale), torch.tensor(argmax))


@contextmanager
def dequantized_base(peft: MixedPeft, mode: str) -> Iterator[None]:
    """Meanwhile ``peft``'s base projections and lm_head hold their dequantized weights, as the
    engine's ``--quantization mode`` computes with them (``quant_linear.quantize``: per output
    channel; int8's scales rounded up to bf16, int8-dynamic's weights 7-bit and rotated, fp8's
    e4m3; ``dequantized_weight``, in the checkpoint's basis); the
    LoRA A and B keep theirs. A tied embedding shares the lm_head's weight, as the engine's
    quantized rows serve its lookups. Restored on exit."""
    from lorastream.worker.model.quant_linear import dequantized_weight

    saved: list[tuple[torch.nn.Linear, torch.Tensor]] = []
    with torch.no_grad():
        for name, module in peft.model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".lora_" not in name:
                saved.append((module, module.weight.detach().clone()))
                module.weight.copy_(dequantized_weight(module.weight, mode))
    try:
        yield
    finally:
        with torch.no_grad():
            for module, weight in saved:
                module.weight.copy_(weight)
