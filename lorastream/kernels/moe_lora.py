"""Expert LoRA on the Triton SGMV kernels: shrink and expand over (slot, expert) segments.

A MoE layer's (token, expert) assignments are rows; a row's *group* is ``slot * E + expert``
(-1 for a row whose adapter does not adapt the experts), and the expert slot storage viewed as
``[S * E, ...]`` is SGMV slot storage of ``S * E`` groups. So the SGMV kernels (``sgmv.py``)
run the expert LoRA unchanged, each (adapter, expert) segment as one of their slots: no host
sync (``SgmvMetadata.from_device_slots``: the groups come from the router, on the device).
"""

from __future__ import annotations

import torch

from lorastream.kernels.sgmv import sgmv_expand, sgmv_shrink


def moe_lora(
    x: torch.Tensor,  # [P, K]
    groups: torch.Tensor,  # [P] int32: slot * E + expert, -1 = no expert adapter
    lora_a: torch.Tensor,  # [G, W * R, K]: the A of W projections that read x, G = S * E
    lora_bs: list[torch.Tensor],  # W x [G, N_w, R]
    scalings: torch.Tensor,  # [G] float32: the group's slot's scaling
    out: torch.Tensor,  # [P, sum N_w], updated in place
) -> torch.Tensor:  # out
    """Add each row's expert LoRA delta for the expert it was routed to.

    Semantics:
        for p in range(P):
            g = groups[p]
            if g == -1:
                continue
            h = x[p].float() @ lora_a[g].float().T                          # [W * R]
            col = 0
            for w, b in enumerate(lora_bs):
                out[p, col : col + N_w] += scalings[g] * h[w R : (w + 1) R] @ b[g].T
                col += N_w

    Ranks below R are zeros in the storage (read, adding nothing).
    """
    num_groups, width, _ = lora_a.shape
    rank = width // len(lora_bs)
    device = x.device
    shrink_ranks = torch.full((num_groups,), width, dtype=torch.int32, device=device)
    h = sgmv_shrink(x, lora_a, groups, shrink_ranks)  # [P, W * R] fp32
    expand_ranks = torch.full((num_groups,), rank, dtype=torch.int32, device=device)
    col = 0
    for w, b in enumerate(lora_bs):
        part = h[:, w * rank : (w + 1) * rank].contiguous()  # [P, R]
        sgmv_expand(part, b, groups, expand_ranks, scalings, out, slice_offset=col)
        col += b.shape[1]
    return out
