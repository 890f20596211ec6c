"""Attention over the paged KV cache for a flat batch (decode rows first, then prefill chunks).

Decode rows attend in one batched call over their gathered blocks with a length mask; each
prefill chunk attends over its cached past plus itself with a causal mask offset by the past.
GQA is handled by SDPA's ``enable_gqa`` (and by grouping query heads on the soft-capped path).

Two per-layer options, as HF transformers defines them:

- ``window`` (sliding-window attention, Mistral / Gemma 2 / Gemma 3 local layers): the query at
  position ``p`` sees key ``j`` iff ``j <= p`` and ``p - j < window`` (transformers'
  ``sliding_window_causal_mask_function``: ``kv_idx > q_idx - sliding_window``). A windowed layer
  gathers only the cache blocks that can hold a key of its window. Example, ``window`` 20,
  blocks of 16, a decode row at position 70: keys 51..70 lie in blocks 3 and 4, so two blocks
  are gathered instead of five.
- ``softcap`` (Gemma 2): ``scores = softcap * tanh(scale * q @ k.T / softcap)``, then the mask,
  then softmax in fp32 (``modeling_gemma2.eager_attention_forward``). SDPA cannot cap its
  logits, so that path multiplies explicitly.

Nothing here reads a device tensor back to the host: block ranges of prefill chunks come from
their host-side lengths, those of decode rows are computed on the device from the shapes.

``native`` (fp32 on the CPU, ``--cpu-kernels``): decode rows run the C++ kernel of
``lorastream/kernels/cpu/attention.py`` instead, which reads the cache blocks in place (same
semantics and score layout; no gathered copy, no SDPA call); prefill chunks keep SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorastream.kernels.cpu.attention import decode_attention, score_width
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


def window_blocks(window: int) -> int:
    """Most cache blocks that ``window`` consecutive positions can touch."""
    return -(-(window - 1) // BLOCK_SIZE) + 1


def _visible(
    qpos: torch.Tensor,  # [..., n, 1] query positions
    kpos: torch.Tensor,  # [..., 1, L] key positions
    window: int | None,
) -> torch.Tensor:  # [..., n, L] bool
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


def _attend(
    q: torch.Tensor,  # [B, H, n, d]
    k: torch.Tensor,  # [B, kvh, L, d]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [B or 1, n, L] bool; None: causal over n == L
    scale: float,
    softcap: float | None,
) -> torch.Tensor:  # [B, H, n, d]
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True
        )
    b, h, n, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    if mask is None:
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril()[None]
    group = h // kvh  # query head i reads kv head i // group, as repeat_kv
    qg = q.reshape(b, kvh, group * n, d)
    scores = (qg @ k.transpose(-1, -2)) * scale  # [B, kvh, g*n, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, kvh, group, n, length)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = probs.view(b, kvh, group * n, length) @ v  # [B, kvh, g*n, d]
    return out.view(b, h, n, d)


def _decode(
    q: torch.Tensor,  # [Bd, H, d]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    window: int | None,
    softcap: float | None,
    native: bool,
) -> torch.Tensor:  # [Bd, H, d]
    tables = batch.decode_block_tables  # [Bd, nb]
    context = batch.decode_context  # [Bd]
    nb = tables.shape[1]
    if native:
        width = score_width(nb, BLOCK_SIZE, None if window is None else window_blocks(window))
        return decode_attention(q, k_cache, v_cache, tables, context, scale, width, window,
                                softcap)
    first = torch.zeros_like(context)  # [Bd] first gathered block of each row
    if window is not None:
        # Only the blocks of each row's window: columns first .. first + nw - 1 of its table.
        # Columns past a row's last block repeat that block (never the table's padding); their
        # positions count as the future and are masked.
        nw = min(window_blocks(window), nb)
        first = (context - window).clamp(min=0) // BLOCK_SIZE
        last = (context - 1) // BLOCK_SIZE
        cols = torch.minimum(first[:, None] + torch.arange(nw, device=q.device), last[:, None])
        tables = tables.gather(1, cols)  # [Bd, nw]
    k = _gather(k_cache, tables)  # [Bd, kvh, L, d]
    v = _gather(v_cache, tables)
    kpos = first[:, None] * BLOCK_SIZE + torch.arange(k.shape[2], device=q.device)  # [Bd, L]
    mask = _visible((context - 1)[:, None, None], kpos[:, None, :], window)  # [Bd, 1, L]
    return _attend(q.unsqueeze(2), k, v, mask, scale, softcap).squeeze(2)


def _prefill(
    q: torch.Tensor,  # [n, H, d]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor,  # [n, kvh, d]
    v_new: torch.Tensor,
    block_table: torch.Tensor,  # [blocks]
    context: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:  # [n, H, d]
    n = q.shape[0]
    past = context - n
    qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
    qpos = torch.arange(past, context, device=q.device)[:, None]  # [n, 1]
    if past == 0:  # the whole prompt: its keys are k_new
        ks = k_new.transpose(0, 1).unsqueeze(0)  # [1, kvh, n, d]
        vs = v_new.transpose(0, 1).unsqueeze(0)
        mask = None
        if window is not None and window < n:
            mask = _visible(qpos, qpos.T, window)[None]  # [1, n, n]
    else:
        # Keys from the window's start (or 0) to the end of the chunk, whole blocks.
        first = 0 if window is None else max(0, past - window + 1) // BLOCK_SIZE
        table = block_table[first : -(-context // BLOCK_SIZE)][None]  # [1, nb]
        start = first * BLOCK_SIZE
        ks = _gather(k_cache, table)[:, :, : context - start]  # [1, kvh, L, d]
        vs = _gather(v_cache, table)[:, :, : context - start]
        kpos = torch.arange(start, context, device=q.device)[None, :]  # [1, L]
        mask = _visible(qpos, kpos, window)[None]  # [1, n, L]
    return _attend(qs, ks, vs, mask, scale, softcap)[0].transpose(0, 1)


def paged_attention(
    q: torch.Tensor,  # [T, H, d]
    k_cache: torch.Tensor,  # [blocks, bs, kvh, d] (this layer, new tokens already written)
    v_cache: torch.Tensor,
    k_new: torch.Tensor,  # [T, kvh, d]
    v_new: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    native: bool = False,
) -> torch.Tensor:  # [T, H, d]
    """Attention of every row of ``batch``; ``window``, ``softcap`` and ``native`` as in the
    module doc."""
    nd = batch.num_decode
    if nd and nd == batch.num_tokens:  # decode only: no copy into a shared output
        return _decode(q, k_cache, v_cache, batch, scale, window, softcap, native)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, batch, scale, window, softcap, native)
    for span in batch.prefills:
        rows = slice(span.start, span.start + span.length)
        out[rows] = _prefill(
            q[rows], k_cache, v_cache, k_new[rows], v_new[rows], span.block_table,
            span.context, scale, window, softcap,
        )
    return out
