"""How close a quantized model's logits are to a reference's, row by row: the figures the
quantization tests bound (tests/worker/model/test_quantization.py on the CPU,
tests/gpu/test_quant_cuda.py on CUDA), computed once for both.

Per row (one teacher-forced position): the max |Δlogit| over the row's largest |logit|; whether
the argmax is the reference's; and whether the position is *decisive*, its reference top-2
margin above ``margin`` of the row's largest |logit| (there a correct model must not move the
argmax; below it, a near-tie, either token may win).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitAgreement:
    worst: float  # the largest max |Δlogit| / max |logit| over all rows
    p95: float  # its 95th percentile
    positions: int
    agree: int  # rows whose argmax is the reference's
    decisive: int  # rows whose reference top-2 margin exceeds the margin
    decisive_agree: int


def logit_agreement(
    pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], margin: float
) -> LogitAgreement:
    """``pairs``: (ours [S, V], reference [S, V]) logits of the same rows."""
    errors: list[float] = []
    agree = decisive = decisive_agree = 0
    for got, expected in pairs:
        got, expected = got.float(), expected.float()
        scale = expected.abs().amax(dim=1)  # [S]
        errors += ((got - expected).abs().amax(dim=1) / scale).tolist()
        same = got.argmax(dim=1) == expected.argmax(dim=1)  # [S]
        top2 = expected.topk(2, dim=1).values  # [S, 2]
        clear = (top2[:, 0] - top2[:, 1]) > margin * scale  # [S] not a near-tie
        agree += int(same.sum())
        decisive += int(clear.sum())
        decisive_agree += int(same[clear].sum())
    errors.sort()
    return LogitAgreement(errors[-1], errors[int(0.95 * len(errors))], len(errors), agree,
                          decisive, decisive_agree)


def within_near_tie(token: int, expected: torch.Tensor, margin: float) -> bool:
    """Whether ``token`` is the argmax of the reference row ``expected [V]``, or within
    ``margin`` of its largest |logit| below it (a near-tie: either token may win)."""
    scale = float(expected.abs().max())
    return float(expected[token]) >= float(expected.max()) - margin * scale
