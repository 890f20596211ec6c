"""Host wrappers for the Triton SGMV kernels: check shapes and dtypes, allocate, launch.

Triton is imported on the first launch (see `_sgmv_triton`), so importing this module works
without Triton installed; calling a kernel then raises a RuntimeError saying what to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType

import torch

from lorastream.kernels.metadata import SgmvMetadata

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Tile sizes. tl.dot needs every tile dimension >= 16 on a GPU; smaller ranks and ragged tails
# are masked inside these tiles.
#
# Dot precision: fp32 models use "ieee". Otherwise the platform default (tf32 on NVIDIA), which is
# exact for the shrink's bf16 tiles upcast to fp32 and, in the expand, rounds h to 10 mantissa
# bits: no coarser than the fp16 / bf16 output it is added to.
_BLOCK_R = 16
_MIN_BLOCK = 16
_MAX_BLOCK_M = 64
_MAX_BLOCK_K = 128
_MAX_BLOCK_N = 128


def sgmv_shrink(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, R_max, K]
    token_slots: torch.Tensor,  # [T] int32, -1 = no adapter
    ranks: torch.Tensor,  # [S] int32
    meta: SgmvMetadata | None = None,
) -> torch.Tensor:  # [T, R_max] float32
    """Project each token onto the LoRA A of its slot, in fp32.

    Semantics:
        h = zeros(T, R_max, dtype=float32)
        for t in range(T):
            s = token_slots[t]
            if s == -1:
                continue
            r = ranks[s]
            h[t, :r] = x[t].float() @ lora_a[s, :r].float().T

    Rows with no adapter and columns at or beyond the slot's rank are 0. Weights beyond a slot's
    rank are never read.

    Args:
        x: `[T, K]` activations, fp16 / bf16 / fp32.
        lora_a: `[S, R_max, K]` slot storage of LoRA A, same dtype as `x`.
        token_slots: `[T]` int32 slot per token on the device of `x`; -1 = no adapter.
        ranks: `[S]` int32 rank per slot on the device of `x`.
        meta: the step's metadata (`SgmvMetadata.from_slots`), shared by every layer. When None
            it is built here: from the tensors directly on the CPU, or on the device without a
            sync but with a worst-case grid.

    Returns:
        `[T, R_max]` float32.
    """
    num_tokens, hidden = _check_matrix("x", x)
    num_slots, max_rank, a_hidden = _check_slot_storage("lora_a", lora_a, x.dtype, x.device)
    if a_hidden != hidden:
        raise ValueError(
            f"lora_a is [S, R_max, K] with K={a_hidden}, but x has hidden size {hidden}"
        )
    _check_slot_tables(token_slots, ranks, None, num_tokens, num_slots, x.device)
    meta = _resolve_meta(meta, token_slots, ranks, max_rank)

    h = torch.zeros((num_tokens, max_rank), dtype=torch.float32, device=x.device)  # [T, R_max]
    if meta.num_segments == 0 or meta.max_seg_len == 0 or meta.max_rank == 0:
        return h
    triton_sgmv = _load_kernels(x.device)
    block_m = _pow2_tile(meta.max_seg_len, _MAX_BLOCK_M)
    block_k = _pow2_tile(hidden, _MAX_BLOCK_K)
    grid = (
        meta.num_segments,
        _cdiv(meta.max_seg_len, block_m),
        _cdiv(min(meta.max_rank, max_rank), _BLOCK_R),
    )
    triton_sgmv.sgmv_shrink_kernel[grid](
        x, lora_a, h,  # matrices
        ranks, meta.token_order, meta.seg_starts, meta.seg_lens, meta.seg_slots,  # metadata
        hidden, max_rank,  # dimensions
        x.stride(0), x.stride(1),  # strides
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        h.stride(0), h.stride(1),
        BLOCK_M=block_m,  # meta-parameters
        BLOCK_R=_BLOCK_R,
        BLOCK_K=block_k,
        UPCAST=x.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
    )  # fmt: skip
    return h


def sgmv_expand(
    h: torch.Tensor,  # [T, R_max] float32
    lora_b: torch.Tensor,  # [S, N, R_max]
    token_slots: torch.Tensor,  # [T] int32, -1 = no adapter
    ranks: torch.Tensor,  # [S] int32
    scalings: torch.Tensor,  # [S] float32
    out: torch.Tensor,  # [T, N_total], updated in place
    slice_offset: int = 0,
    meta: SgmvMetadata | None = None,
) -> torch.Tensor:  # out
    """Add each token's scaled LoRA B projection into a column slice of the layer output.

    Semantics:
        for t in range(T):
            s = token_slots[t]
            if s == -1:
                continue
            r = ranks[s]
            delta = scalings[s] * (h[t, :r] @ lora_b[s, :, :r].float().T)   # fp32
            out[t, slice_offset : slice_offset + N] = (
                out[t, slice_offset : slice_offset + N].float() + delta
            ).to(out.dtype)

    Rows with no adapter are left untouched. `h` beyond a slot's rank and B beyond it are never
    read. Accumulation is fp32; `out` is rounded once, at the end.

    Args:
        h: `[T, R_max]` float32, usually the output of `sgmv_shrink`.
        lora_b: `[S, N, R_max]` slot storage of LoRA B, in the dtype of `out`.
        token_slots: `[T]` int32 slot per token; -1 = no adapter.
        ranks: `[S]` int32 rank per slot.
        scalings: `[S]` float32 scaling per slot (alpha / rank for PEFT adapters).
        out: `[T, N_total]` layer output, fp16 / bf16 / fp32; columns
            `[slice_offset, slice_offset + N)` are updated in place.
        slice_offset: first output column of this projection's slice (q / k / v, gate / up).
        meta: the step's metadata, as for `sgmv_shrink`.

    Returns:
        `out`.
    """
    num_tokens, out_width = _check_matrix("out", out)
    num_slots, out_features, max_rank = _check_slot_storage("lora_b", lora_b, out.dtype, out.device)
    h_tokens, h_rank = _check_matrix("h", h)
    if h.dtype != torch.float32 or h.device != out.device:
        raise ValueError(f"h must be float32 on {out.device}; got {h.dtype} on {h.device}")
    if (h_tokens, h_rank) != (num_tokens, max_rank):
        raise ValueError(
            f"h must be [T, R_max] = [{num_tokens}, {max_rank}] to match out and lora_b; "
            f"got {list(h.shape)}"
        )
    if slice_offset < 0 or slice_offset + out_features > out_width:
        raise ValueError(
            f"slice [{slice_offset}, {slice_offset + out_features}) of N={out_features} columns "
            f"does not fit in out with {out_width} columns"
        )
    _check_slot_tables(token_slots, ranks, scalings, num_tokens, num_slots, out.device)
    meta = _resolve_meta(meta, token_slots, ranks, max_rank)

    if meta.num_segments == 0 or meta.max_seg_len == 0 or meta.max_rank == 0:
        return out
    triton_sgmv = _load_kernels(out.device)
    block_m = _pow2_tile(meta.max_seg_len, _MAX_BLOCK_M)
    block_n = _pow2_tile(out_features, _MAX_BLOCK_N)
    grid = (meta.num_segments, _cdiv(meta.max_seg_len, block_m), _cdiv(out_features, block_n))
    triton_sgmv.sgmv_expand_kernel[grid](
        h, lora_b, out,  # matrices
        ranks, scalings, meta.token_order, meta.seg_starts, meta.seg_lens, meta.seg_slots,
        out_features, max_rank, slice_offset,  # dimensions
        h.stride(0), h.stride(1),  # strides
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m,  # meta-parameters
        BLOCK_N=block_n,
        BLOCK_R=_BLOCK_R,
        DOT_PRECISION="ieee" if out.dtype == torch.float32 else None,
    )  # fmt: skip
    return out


def sgmv_expand_slices(
    h_slices: Sequence[torch.Tensor],  # each [T, R_max] float32
    lora_b_slices: Sequence[torch.Tensor],  # slice i: [S, N_i, R_max]
    token_slots: torch.Tensor,  # [T] int32
    ranks: torch.Tensor,  # [S] int32
    scalings: torch.Tensor,  # [S] float32
    out: torch.Tensor,  # [T, N_total]
    slice_offsets: Sequence[int] | None = None,
    meta: SgmvMetadata | None = None,
) -> torch.Tensor:  # out
    """Expand several projections that share one output (q / k / v under GQA, gate / up).

    Semantics:
        for i in range(len(h_slices)):
            sgmv_expand(h_slices[i], lora_b_slices[i], token_slots, ranks, scalings, out,
                        slice_offset=slice_offsets[i], meta=meta)

    This is one launch per slice with a column offset, not a fused kernel: slices may have
    unequal widths (q 4096, k / v 1024 for Llama-3-8B) and each launch sizes its grid to its own
    width. `slice_offsets` defaults to the running sum of the slice widths, i.e. the slices
    are laid side by side from column 0. Pass the step's `meta`: with None, every slice builds
    its own.
    """
    if len(h_slices) != len(lora_b_slices) or not h_slices:
        raise ValueError(
            f"need one h per lora_b slice and at least one slice; got {len(h_slices)} h and "
            f"{len(lora_b_slices)} lora_b"
        )
    if slice_offsets is None:
        if any(b.dim() != 3 for b in lora_b_slices):
            raise ValueError("every lora_b slice must be 3-D slot storage [S, N_i, R_max]")
        widths = [b.shape[1] for b in lora_b_slices]
        slice_offsets = [sum(widths[:i]) for i in range(len(widths))]
    if len(slice_offsets) != len(lora_b_slices):
        raise ValueError(
            f"slice_offsets has {len(slice_offsets)} entries for {len(lora_b_slices)} slices"
        )
    for h, lora_b, offset in zip(h_slices, lora_b_slices, slice_offsets, strict=True):
        sgmv_expand(h, lora_b, token_slots, ranks, scalings, out, offset, meta)
    return out


def check_available(device: torch.device | str) -> None:
    """Raise RuntimeError (saying what to install or set) unless the kernels can run on `device`.

    Defines the kernels now, so a server can refuse a misconfiguration at startup.
    """
    _load_kernels(torch.device(device))


def _load_kernels(device: torch.device) -> ModuleType:
    try:
        module = importlib.import_module("lorastream.kernels._sgmv_triton")
    except ImportError as exc:
        raise RuntimeError(
            "the SGMV kernels need Triton: install lorastream[gpu] (triton==3.7.1), or use the "
            "torch reference in lorastream.kernels.reference"
        ) from exc
    if device.type == "cpu" and not module.is_interpreted():
        raise RuntimeError(
            "the Triton SGMV kernels were defined for a GPU but got CPU tensors: set "
            "TRITON_INTERPRET=1 before the first kernel call to run them in the interpreter, "
            "or use the torch reference in lorastream.kernels.reference"
        )
    return module


def _resolve_meta(
    meta: SgmvMetadata | None,
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
) -> SgmvMetadata:
    if meta is None:
        if token_slots.device.type == "cpu":
            return SgmvMetadata.from_slots(token_slots, ranks, token_slots.device)
        return SgmvMetadata.from_device_slots(token_slots, ranks.shape[0], max_rank)
    if not isinstance(meta, SgmvMetadata):
        raise ValueError(f"meta must be an SgmvMetadata or None; got {type(meta).__name__}")
    if meta.num_tokens != token_slots.shape[0]:
        raise ValueError(
            f"meta was built for {meta.num_tokens} tokens but this call has "
            f"{token_slots.shape[0]}; build SgmvMetadata once per step from that step's slots"
        )
    if meta.device != token_slots.device:
        raise ValueError(f"meta is on {meta.device} but the tensors are on {token_slots.device}")
    return meta


def _check_matrix(name: str, tensor: torch.Tensor) -> tuple[int, int]:
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be 2-D; got shape {list(tensor.shape)}")
    return tensor.shape[0], tensor.shape[1]


def _check_slot_storage(
    name: str, storage: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, int]:
    if storage.dim() != 3:
        raise ValueError(f"{name} must be 3-D slot storage; got shape {list(storage.shape)}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if storage.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype} to match; got {storage.dtype}")
    if storage.device != device:
        raise ValueError(f"{name} must be on {device}; got {storage.device}")
    return storage.shape[0], storage.shape[1], storage.shape[2]


def _check_slot_tables(
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor | None,
    num_tokens: int,
    num_slots: int,
    device: torch.device,
) -> None:
    tables = [("token_slots", token_slots, torch.int32, num_tokens, "T"),
              ("ranks", ranks, torch.int32, num_slots, "S")]  # fmt: skip
    if scalings is not None:
        tables.append(("scalings", scalings, torch.float32, num_slots, "S"))
    for name, table, dtype, length, dim in tables:
        if table.dim() != 1 or table.dtype != dtype or table.shape[0] != length:
            raise ValueError(
                f"{name} must be a 1-D {dtype} tensor of length {dim}={length}; "
                f"got shape {list(table.shape)}, {table.dtype}"
            )
        if table.device != device:
            raise ValueError(f"{name} must be on {device}; got {table.device}")


def _pow2_tile(size: int, largest: int) -> int:
    tile = _MIN_BLOCK
    while tile < size and tile < largest:
        tile *= 2
    return tile


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
