"""Decode attention over the paged KV cache on the CPU, reading the cache blocks in place.

The torch path (``worker/model/attention.py``) gathers every decode row's blocks into a padded
copy and runs SDPA over it with a mask: at decode shapes most of its time is that copy and SDPA's
per-call overhead, not arithmetic. These two C++ ops (``csrc/decode_attention.cpp``) read each
key and value where it lies; the softmax between them is torch's.

Semantics (fp32; ``B`` decode rows, ``H`` query heads over ``kvh`` kv heads, ``g = H // kvh``)::

    # row b sees positions lo .. ctx-1, ctx = context[b], lo = max(0, ctx - window) (no window: 0)
    # its score row holds positions first*bs .. first*bs + width - 1, first = lo // bs
    key(b, p, h)   = k_cache[tables[b, p // bs], p % bs, h]          # [d]
    decode_scores: scores[b, i, p - first*bs] = cap(scale * q[b, i] · key(b, p, i // g))
                   for visible p; -inf at every other column
                   cap(s) = softcap * tanh(s / softcap) if softcap else s
    probs = softmax(scores, dim=-1)                                   # torch.softmax
    decode_values: out[b, i] = sum over visible p of
                   probs[b, i, p - first*bs] * value(b, p, i // g)

which is ``attention.py``'s ``_decode`` (and transformers' eager attention: GQA as ``repeat_kv``,
the soft cap before the mask) with the same score layout, in a different summation order.
tests/worker/model/test_attention.py holds both paths to a dense fp64 reference.

Built with the other CPU ops by :func:`lorastream.kernels.cpu.ops.load` (``--cpu-kernels``,
docs/worker.md).
"""

from __future__ import annotations

import torch


def score_width(num_blocks: int, block_size: int, window_blocks: int | None) -> int:
    """Columns of a score row: the blocks attention.py gathers per row (all of the table's, or a
    window's worth), times the block size."""
    blocks = num_blocks if window_blocks is None else min(window_blocks, num_blocks)
    return blocks * block_size


def decode_attention(
    q: torch.Tensor,  # [B, H, d] fp32
    k_cache: torch.Tensor,  # [blocks, bs, kvh, d] fp32, this layer's
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # [B, nb] int64 block table per row (padded)
    context: torch.Tensor,  # [B] int64 cache length of each row, its new token included
    scale: float,
    width: int,  # score columns (score_width)
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [B, H, d]
    """Attention of each decode row over its cache (module docstring); :func:`load` first."""
    q = q.contiguous()
    scores = q.new_empty((q.shape[0], q.shape[1], width))  # [B, H, width]
    ops = torch.ops.lorastream
    ops.decode_scores(q, k_cache, tables, context, scale, window or 0, softcap or 0.0, scores)
    probs = torch.softmax(scores, dim=-1)  # [B, H, width]
    out = torch.empty_like(q)
    ops.decode_values(probs, v_cache, tables, context, window or 0, out)
    return out

