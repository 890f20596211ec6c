"""Attention over the paged KV cache for a flat batch (decode rows first, then prefill chunks).

Decode rows attend in one batched SDPA call over their gathered blocks with a length mask;
each prefill chunk attends over its cached past plus itself with a causal mask offset by the past.
GQA is handled by SDPA's ``enable_gqa``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorastream.worker.model.forward_batch import ForwardBatch
from lorastream.worker.model.kv_cache import BLOCK_SIZE


def write_kv(
    k_cache: torch.Tensor,  # [blocks, bs, kvh, d]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [T, kvh, d]
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[blocks, bs, kvh, d] gathered by [B, nb] -> [B, kvh, nb*bs, d]."""
    b, nb = block_tables.shape
    gathered = cache.index_select(0, block_tables.reshape(-1))  # [B * nb, bs, kvh, d]
    return gathered.view(b, nb * BLOCK_SIZE, *cache.shape[2:]).transpose(1, 2)


def paged_attention(
    q: torch.Tensor,  # [T, H, d]
    k_cache: torch.Tensor,  # [blocks, bs, kvh, d] (this layer, new tokens already written)
    v_cache: torch.Tensor,
    k_new: torch.Tensor,  # [T, kvh, d]
    v_new: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:  # [T, H, d]
    out = torch.empty_like(q)
    nd = batch.num_decode
    if nd:
        k = _gather(k_cache, batch.decode_block_tables)  # [Bd, kvh, L, d]
        v = _gather(v_cache, batch.decode_block_tables)
        length = k.shape[2]
        mask = torch.arange(length, device=q.device) < batch.decode_context[:, None]  # [Bd, L]
        attn = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2),  # [Bd, H, 1, d]
            k,
            v,
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )  # [Bd, H, 1, d]
        out[:nd] = attn.squeeze(2)
    for span in batch.prefills:
        rows = slice(span.start, span.start + span.length)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        past = span.context - span.length
        if past == 0:
            ks = k_new[rows].transpose(0, 1).unsqueeze(0)  # [1, kvh, n, d]
            vs = v_new[rows].transpose(0, 1).unsqueeze(0)
            attn = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            table = span.block_table[: -(-span.context // BLOCK_SIZE)][None]  # [1, nb]
            ks = _gather(k_cache, table)[:, :, : span.context]  # [1, kvh, ctx, d]
            vs = _gather(v_cache, table)[:, :, : span.context]
            # Query i sits at position past + i and sees keys 0 .. past + i.
            qpos = torch.arange(span.length, device=q.device)[:, None] + past
            mask = torch.arange(span.context, device=q.device)[None, :] <= qpos  # [n, ctx]
            attn = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask[None, None], scale=scale, enable_gqa=True
            )
        out[rows] = attn[0].transpose(0, 1)
    return out
