"""Pure torch SGMV: gather each token's slot weights, one batched matmul, in fp32.

Same semantics and signatures as `lorastream.kernels.sgmv` (the docstrings there hold the
pseudo-code).
Simple rather than fast: it materialises a copy of the weights per token and syncs to find the
rows that have an adapter. It is the reference the Triton kernels are tested against and the
obviously-correct fallback on machines without Triton.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def sgmv_shrink_ref(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, R_max, K]
    token_slots: torch.Tensor,  # [T] int32, -1 = no adapter
    ranks: torch.Tensor,  # [S] int32
) -> torch.Tensor:  # [T, R_max] float32
    """h[t, :ranks[s]] = x[t] @ lora_a[s, :ranks[s]]ᵀ, s = token_slots[t]; everything else 0."""
    num_tokens, max_rank = x.shape[0], lora_a.shape[1]
    h = torch.zeros((num_tokens, max_rank), dtype=torch.float32, device=x.device)
    rows = torch.nonzero(token_slots >= 0).squeeze(1)  # [T']
    if rows.numel() == 0:
        return h
    slots = token_slots[rows].long()  # [T']
    within_rank = _rank_mask(ranks[slots], max_rank)  # [T', R_max]
    a = lora_a[slots].float().where(within_rank[:, :, None], 0.0)  # [T', R_max, K]
    h[rows] = torch.bmm(a, x[rows].float()[:, :, None])[:, :, 0]  # [T', R_max]
    return h


def sgmv_expand_ref(
    h: torch.Tensor,  # [T, R_max] float32
    lora_b: torch.Tensor,  # [S, N, R_max]
    token_slots: torch.Tensor,  # [T] int32, -1 = no adapter
    ranks: torch.Tensor,  # [S] int32
    scalings: torch.Tensor,  # [S] float32
    out: torch.Tensor,  # [T, N_total], updated in place
    slice_offset: int = 0,
) -> torch.Tensor:  # out
    """out[t, off:off+N] += scalings[s] * h[t, :ranks[s]] @ lora_b[s, :, :ranks[s]]ᵀ (fp32)."""
    out_features, max_rank = lora_b.shape[1], lora_b.shape[2]
    rows = torch.nonzero(token_slots >= 0).squeeze(1)  # [T']
    if rows.numel() == 0:
        return out
    slots = token_slots[rows].long()  # [T']
    within_rank = _rank_mask(ranks[slots], max_rank)  # [T', R_max]
    b = lora_b[slots].float().where(within_rank[:, None, :], 0.0)  # [T', N, R_max]
    h_rows = h[rows].float().where(within_rank, 0.0)  # [T', R_max]
    delta = torch.bmm(b, h_rows[:, :, None])[:, :, 0] * scalings[slots].float()[:, None]  # [T', N]
    columns = slice(slice_offset, slice_offset + out_features)
    out[rows, columns] = (out[rows, columns].float() + delta).to(out.dtype)
    return out


def sgmv_expand_slices_ref(
    h_slices: Sequence[torch.Tensor],  # each [T, R_max] float32
    lora_b_slices: Sequence[torch.Tensor],  # slice i: [S, N_i, R_max]
    token_slots: torch.Tensor,  # [T] int32
    ranks: torch.Tensor,  # [S] int32
    scalings: torch.Tensor,  # [S] float32
    out: torch.Tensor,  # [T, N_total]
    slice_offsets: Sequence[int] | None = None,
) -> torch.Tensor:  # out
    """`sgmv_expand_ref` per slice; offsets default to the running sum of slice widths."""
    if slice_offsets is None:
        widths = [b.shape[1] for b in lora_b_slices]
        slice_offsets = [sum(widths[:i]) for i in range(len(widths))]
    for h, lora_b, offset in zip(h_slices, lora_b_slices, slice_offsets, strict=True):
        sgmv_expand_ref(h, lora_b, token_slots, ranks, scalings, out, offset)
    return out


def _rank_mask(token_ranks: torch.Tensor, max_rank: int) -> torch.Tensor:
    """[T'] ranks -> [T', R_max] bool mask, True for columns below each token's rank."""
    columns = torch.arange(max_rank, device=token_ranks.device)  # [R_max]
    return columns[None, :] < token_ranks[:, None]
