"""Host wrappers reject wrong shapes and dtypes with a ValueError saying what to fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lorastream.kernels import SgmvMetadata, sgmv_expand, sgmv_expand_slices, sgmv_shrink

T, K, S, R, N = 4, 32, 3, 16, 24


def _shrink_args() -> dict[str, Any]:
    return {
        "x": torch.randn(T, K, dtype=torch.float16),
        "lora_a": torch.randn(S, R, K, dtype=torch.float16),
        "token_slots": torch.tensor([0, 1, -1, 2], dtype=torch.int32),
        "ranks": torch.tensor([4, 8, 16], dtype=torch.int32),
    }


def _expand_args() -> dict[str, Any]:
    return {
        "h": torch.randn(T, R),
        "lora_b": torch.randn(S, N, R, dtype=torch.bfloat16),
        "token_slots": torch.tensor([0, 1, -1, 2], dtype=torch.int32),
        "ranks": torch.tensor([4, 8, 16], dtype=torch.int32),
        "scalings": torch.ones(S),
        "out": torch.zeros(T, N, dtype=torch.bfloat16),
    }


def _other_batch_meta() -> SgmvMetadata:
    return SgmvMetadata.from_slots(
        torch.tensor([0], dtype=torch.int32), torch.tensor([4, 8, 16], dtype=torch.int32), "cpu"
    )


Change = Callable[[dict[str, Any]], None]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(x=torch.randn(K, dtype=torch.float16)), "x must be 2-D"),
        (lambda a: a.update(lora_a=torch.randn(R, K, dtype=torch.float16)), "lora_a must be 3-D"),
        (
            lambda a: a.update(lora_a=torch.randn(S, R, K + 1, dtype=torch.float16)),
            "K=33, but x has hidden size 32",
        ),
        (
            lambda a: a.update(lora_a=a["lora_a"].float()),
            "lora_a must have dtype torch.float16",
        ),
        (
            lambda a: a.update(x=a["x"].double(), lora_a=a["lora_a"].double()),
            "dtype torch.float64 is not supported",
        ),
        (
            lambda a: a.update(token_slots=a["token_slots"].long()),
            "token_slots must be a 1-D torch.int32 tensor of length T=4",
        ),
        (
            lambda a: a.update(token_slots=a["token_slots"][:3]),
            "token_slots must be a 1-D torch.int32 tensor of length T=4",
        ),
        (
            lambda a: a.update(ranks=torch.tensor([4, 8], dtype=torch.int32)),
            "ranks must be a 1-D torch.int32 tensor of length S=3",
        ),
        (lambda a: a.update(meta=_other_batch_meta()), "meta was built for 1 tokens"),
        (lambda a: a.update(meta="not metadata"), "meta must be an SgmvMetadata"),
    ],
)
def test_shrink_rejects_bad_arguments_with_a_clear_message(change: Change, message: str) -> None:
    args = _shrink_args()
    change(args)
    with pytest.raises(ValueError, match=message):
        sgmv_shrink(**args)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(h=a["h"].half()), "h must be float32"),
        (lambda a: a.update(h=torch.randn(T, R + 1)), r"h must be \[T, R_max\] = \[4, 16\]"),
        (lambda a: a.update(out=torch.zeros(T, N)), "lora_b must have dtype torch.float32"),
        (lambda a: a.update(slice_offset=1), r"slice \[1, 25\) .* does not fit in out"),
        (lambda a: a.update(slice_offset=-1), "does not fit in out"),
        (
            lambda a: a.update(scalings=torch.ones(S, dtype=torch.float16)),
            "scalings must be a 1-D torch.float32 tensor of length S=3",
        ),
        (
            lambda a: a.update(out=torch.zeros(T + 1, N, dtype=torch.bfloat16)),
            r"h must be \[T, R_max\] = \[5, 16\]",
        ),
    ],
)
def test_expand_rejects_bad_arguments_with_a_clear_message(change: Change, message: str) -> None:
    args = _expand_args()
    change(args)
    with pytest.raises(ValueError, match=message):
        sgmv_expand(**args)


@pytest.mark.parametrize(
    ("num_h", "slice_offsets", "message"),
    [
        (1, None, "need one h per lora_b slice"),
        (2, [0], "slice_offsets has 1 entries for 2 slices"),
    ],
)
def test_expand_slices_rejects_mismatched_slice_tables(
    num_h: int, slice_offsets: list[int] | None, message: str
) -> None:
    args = _expand_args()
    lora_b = args.pop("lora_b")
    h = args.pop("h")
    out = torch.zeros(T, 2 * N, dtype=torch.bfloat16)
    args["out"] = out
    with pytest.raises(ValueError, match=message):
        sgmv_expand_slices([h] * num_h, [lora_b, lora_b], slice_offsets=slice_offsets, **args)
