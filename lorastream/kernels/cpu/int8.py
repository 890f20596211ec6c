"""int8 weight-only products on the CPU in one C++ op (``csrc/int8_weight_mm.cpp``).

torch's CPU kernel for them (``aten._weight_int8pack_mm``) takes bf16 activations: it rounds
each to 8 significant bits, and without AVX-512 it converts weights and activations row by row
(slower than the fp32 product from a few rows on). The op keeps the activations in fp32, over
weights packed once at load in blocks of 16 output channels (:func:`pack`): up to four rows, it
converts each k's 16 int8 weights once and multiplies them into every row (one read of each
weight byte, 4x fewer bytes than the fp32 product); from five rows on, it converts a block to an
fp32 panel once and runs a 6-row x 16-channel register tile of AVX2 FMAs over it, as the fp32
GEMMs do (7 or 8 rows left over take 4-row tiles: 4 + 4 keeps the FMA units busier than 6 + 2).

Semantics (``x`` fp32, ``wq`` int8 [N, K], ``scale`` fp32 [N])::

    packed = pack(wq)                                              # [ceil(N/16), K, 16] int8
    packed[b, k, c] = wq[16 b + c, k]   (0 past N)
    out[t, n] = scale[n] * sum_k x[t, k] * float(wq[n, k])        # [T, N] fp32, fp32 sums

which is ``x @ (wq.float() * scale[:, None]).T`` up to the order of the sums (int8-mode scales
are bf16 values; the op applies each after its sum). tests/kernels/test_cpu_int8.py holds the
op to that product.
"""

from __future__ import annotations

import torch

BLOCK = 16  # output channels per packed block


def pack(wq: torch.Tensor) -> torch.Tensor:  # [N, K] int8 -> [ceil(N / 16), K, 16] int8
    """The op's layout of ``wq`` (module docstring)."""
    n, k = wq.shape
    blocks = -(-n // BLOCK)
    padded = torch.zeros(blocks * BLOCK, k, dtype=torch.int8, device=wq.device)  # [N', K]
    padded[:n] = wq
    return padded.view(blocks, BLOCK, k).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:  # -> [N, K] int8, a copy
    """``wq`` back from :func:`pack`'s layout."""
    blocks, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * BLOCK, k)[:n].contiguous()


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., K]
    """Rows ``ids`` of ``wq``, gathered from the packed layout (no whole copy)."""
    return packed[ids // BLOCK, :, ids % BLOCK]


def int8_weight_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [T, K]`` fp32, ``packed`` (:func:`pack`), ``scale [N]`` fp32 -> ``[T, N]`` fp32 per
    the module docstring (``cpu_ops.load()`` first)."""
    return torch.ops.lorastream.int8_weight_mm(x, packed, scale)
