"""Triton SGMV kernels (shrink and expand). Imported lazily, on the first kernel call.

Why lazily: `@triton.jit` decides at definition time whether a kernel runs on a GPU or in the
Triton interpreter (`TRITON_INTERPRET=1`). Defining the kernels only when a kernel is first
launched lets tests set the variable in a conftest, whatever imported `kernels` before, and
keeps `import lorastream.kernels` working on machines without Triton.

Both kernels walk the segments of an `SgmvMetadata` (tokens grouped by slot):

    grid axis 0: segment g              -> slot s = seg_slots[g], rank r = ranks[s]
    grid axis 1: a BLOCK_M tile of the segment's tokens (gathered through token_order)
    grid axis 2: shrink: a BLOCK_R tile of rank columns; expand: a BLOCK_N tile of outputs

Programs past the end of their segment, or (shrink) whose rank tile starts at or beyond r, return
at once; expand loops over rank tiles only up to r. So the work follows each adapter's real rank,
and tokens without an adapter, which belong to no segment, cost nothing.
"""

# Kernel parameters are untyped, as in Triton's tutorials: Triton reads parameter annotations
# itself (tl.constexpr), and the values are pointers, ints or constexprs chosen at launch.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sgmv_shrink_kernel(
    # Pointers to matrices
    x_ptr,  # [T, K] activations
    a_ptr,  # [S, R_MAX, K] LoRA A slot storage
    h_ptr,  # [T, R_MAX] float32 output, zero-filled by the host
    # Pointers to per-step metadata
    ranks_ptr,  # [S] int32
    token_order_ptr,  # [T_active] int32
    seg_starts_ptr,  # [G] int32
    seg_lens_ptr,  # [G] int32
    seg_slots_ptr,  # [G] int32
    # Matrix dimensions
    K,
    R_MAX,
    # Strides (elements to step to the next row / column)
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_ht,
    stride_hr,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # load tiles as fp32 before tl.dot (bf16: the interpreter needs it)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs; None: the platform default
):
    """h[t, r] = sum_k x[t, k] * a[s, r, k] for the tokens and rank tile of this program."""
    seg = tl.program_id(axis=0)
    pid_m = tl.program_id(axis=1)
    pid_r = tl.program_id(axis=2)

    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    slot = tl.load(seg_slots_ptr + seg)
    rank = tl.minimum(tl.load(ranks_ptr + slot), R_MAX)
    if pid_r * BLOCK_R >= rank:
        return
    seg_start = tl.load(seg_starts_ptr + seg)

    # Rows of this tile: gathered token indices; ragged tail masked.
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    rows = tl.load(token_order_ptr + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64)
    # Rank columns of this tile: ranks below 16 live inside a 16-wide tile, masked.
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    a_ptrs = (
        a_ptr
        + slot.to(tl.int64) * stride_as
        + offs_r[None, :] * stride_ar
        + offs_k[:, None] * stride_ak
    )  # [BLOCK_K, BLOCK_R]: A[s] read transposed
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0  # odd K: the last tile is ragged
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak

    h_ptrs = h_ptr + rows[:, None] * stride_ht + offs_r[None, :] * stride_hr
    tl.store(h_ptrs, acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def sgmv_expand_kernel(
    # Pointers to matrices
    h_ptr,  # [T, R_MAX] float32 shrink output
    b_ptr,  # [S, N, R_MAX] LoRA B slot storage
    out_ptr,  # [T, N_TOTAL] layer output, updated in place
    # Pointers to per-step metadata
    ranks_ptr,  # [S] int32
    scalings_ptr,  # [S] float32
    token_order_ptr,  # [T_active] int32
    seg_starts_ptr,  # [G] int32
    seg_lens_ptr,  # [G] int32
    seg_slots_ptr,  # [G] int32
    # Matrix dimensions
    N,
    R_MAX,
    SLICE_OFFSET,  # first output column of this slice
    # Strides (elements to step to the next row / column)
    stride_ht,
    stride_hr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_ot,
    stride_on,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for an fp32 output; None: the platform default
):
    """out[t, off + n] += scaling[s] * sum_{r < rank} h[t, r] * b[s, n, r] for this tile."""
    seg = tl.program_id(axis=0)
    pid_m = tl.program_id(axis=1)
    pid_n = tl.program_id(axis=2)

    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    slot = tl.load(seg_slots_ptr + seg)
    rank = tl.minimum(tl.load(ranks_ptr + slot), R_MAX)
    if rank <= 0:
        return
    seg_start = tl.load(seg_starts_ptr + seg)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    rows = tl.load(token_order_ptr + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)

    h_ptrs = h_ptr + rows[:, None] * stride_ht + offs_r[None, :] * stride_hr  # [BLOCK_M, BLOCK_R]
    b_ptrs = (
        b_ptr
        + slot.to(tl.int64) * stride_bs
        + offs_n[None, :] * stride_bn
        + offs_r[:, None] * stride_br
    )  # [BLOCK_R, BLOCK_N]: B[s] read transposed
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # loop steps follow this adapter's rank
        mask_r = offs_r < rank - r0
        h = tl.load(h_ptrs, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(h, b.to(tl.float32), acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_R * stride_hr
        b_ptrs += BLOCK_R * stride_br

    scaling = tl.load(scalings_ptr + slot)
    out_ptrs = out_ptr + rows[:, None] * stride_ot + (SLICE_OFFSET + offs_n[None, :]) * stride_on
    mask_out = mask_m[:, None] & mask_n[None, :]
    current = tl.load(out_ptrs, mask=mask_out, other=0.0).to(tl.float32)
    updated = current + scaling * acc
    tl.store(out_ptrs, updated.to(out_ptr.dtype.element_ty), mask=mask_out)


def is_interpreted() -> bool:
    """True when these kernels were defined under `TRITON_INTERPRET=1` (they run on the CPU)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(sgmv_shrink_kernel, InterpretedFunction)


__all__ = ["is_interpreted", "sgmv_expand_kernel", "sgmv_shrink_kernel"]
