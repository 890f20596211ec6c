"""Per-step SGMV metadata: which tokens go to which slot, grouped into segments.

One `SgmvMetadata` is built per step, from the slot of every token and the rank of every slot,
and then reused by every LoRA layer of that step (shrink and expand, all projections): it depends
only on the batch, never on a layer's weights or dimensions.

A worked example (5 active tokens, one token without an adapter, 3 slots):

    token_slots = [2, -1, 0, 2, 0, 2]     # slot per token, -1 = no adapter
    ranks       = [8, 0, 16]              # rank per slot (slot 1 is empty)

    token_order = [2, 4, 0, 3, 5]         # token indices, grouped by slot (stable)
    seg_starts  = [0, 2]                  # where each segment begins in token_order
    seg_lens    = [2, 3]
    seg_slots   = [0, 2]
    num_segments = 2, max_seg_len = 3, max_rank = 16

Token 1 (slot -1) appears in no segment, so the kernels launch no work for it.

On CUDA, build on the host into a pinned staging buffer and copy once with `non_blocking=True`:

    staging = SgmvMetadata.allocate_staging(max_tokens, num_slots, device)   # once, pinned
    device_buf = SgmvMetadata.allocate_device_buffer(max_tokens, num_slots, device)  # once
    meta = SgmvMetadata.from_slots(slots_cpu, ranks_cpu, device, staging, device_buf)  # per step

Nothing here reads device memory, so building metadata never forces a host-device sync. A pinned
staging buffer must not be refilled while its previous copy may still be in flight: keep two and
alternate, or wait on an event recorded after the previous copy. With `device_buffer`, the tensors
the kernels read keep fixed addresses from step to step (what CUDA-graph capture needs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_INDEX_DTYPE = torch.int32


@dataclass(frozen=True)
class SgmvMetadata:
    """Tokens grouped by slot, plus the host-side bounds the kernels size their grids with.

    The four tensors live on the compute device and are int32. The ints are host values: the
    grids are sized from them without reading device memory.
    """

    token_order: torch.Tensor  # [>= sum(seg_lens)] int32: token indices grouped by slot
    seg_starts: torch.Tensor  # [G] int32: first position of each segment in token_order
    seg_lens: torch.Tensor  # [G] int32: tokens in each segment (may be 0 in device-built meta)
    seg_slots: torch.Tensor  # [G] int32: slot of each segment
    num_tokens: int  # T: rows of x / h / out, including rows without an adapter
    num_segments: int  # G: grid size along the segment axis
    max_seg_len: int  # upper bound on seg_lens: grid size along the token axis
    max_rank: int  # upper bound on the rank of any segment's slot: grid along the rank axis

    @property
    def device(self) -> torch.device:
        return self.token_order.device

    @staticmethod
    def buffer_capacity(max_tokens: int, num_slots: int) -> int:
        """Int32 elements a staging / device buffer needs for batches of up to `max_tokens`."""
        return max_tokens + 3 * min(max_tokens, num_slots)

    @staticmethod
    def allocate_staging(max_tokens: int, num_slots: int, device: torch.device) -> torch.Tensor:
        """A host staging buffer for `from_slots`; pinned when `device` is CUDA."""
        pin = torch.device(device).type == "cuda"
        capacity = SgmvMetadata.buffer_capacity(max_tokens, num_slots)
        return torch.empty(capacity, dtype=_INDEX_DTYPE, pin_memory=pin)

    @staticmethod
    def allocate_device_buffer(
        max_tokens: int, num_slots: int, device: torch.device
    ) -> torch.Tensor:
        """A fixed-address device buffer for `from_slots` to copy the metadata into."""
        capacity = SgmvMetadata.buffer_capacity(max_tokens, num_slots)
        return torch.empty(capacity, dtype=_INDEX_DTYPE, device=device)

    @classmethod
    def from_slots(
        cls,
        token_slots_cpu: torch.Tensor,  # [T] int32, on the host; -1 = no adapter
        ranks_cpu: torch.Tensor,  # [S] int32, on the host
        device: torch.device | str,
        staging: torch.Tensor | None = None,  # [capacity] int32 host buffer (pinned on CUDA)
        device_buffer: torch.Tensor | None = None,  # [capacity] int32 buffer on `device`
    ) -> SgmvMetadata:
        """Group tokens by slot on the host and copy the result to `device` in one transfer.

        Tokens whose slot is -1, or whose slot has rank 0, belong to no segment. Segments are
        ordered by slot; tokens keep their batch order inside a segment.

        Raises:
            ValueError: the inputs are not 1-D int32 host tensors, a slot is out of range, a rank
                is negative, or a buffer is too small / of the wrong dtype or device.
        """
        device = torch.device(device)
        _check_host_index("token_slots_cpu", token_slots_cpu)
        _check_host_index("ranks_cpu", ranks_cpu)
        num_slots = ranks_cpu.numel()
        slots = token_slots_cpu.to(torch.int64)  # [T]
        ranks = ranks_cpu.to(torch.int64)  # [S]
        if slots.numel() > 0 and (int(slots.min()) < -1 or int(slots.max()) >= num_slots):
            raise ValueError(
                f"token_slots_cpu values must lie in [-1, {num_slots}) for {num_slots} slots; "
                f"got min {int(slots.min())}, max {int(slots.max())}"
            )
        if ranks.numel() > 0 and int(ranks.min()) < 0:
            raise ValueError(f"ranks_cpu must be >= 0; got min {int(ranks.min())}")

        if num_slots == 0:
            has_adapter = torch.zeros_like(slots, dtype=torch.bool)  # [T]
        else:
            has_adapter = (slots >= 0) & (ranks[slots.clamp(min=0)] > 0)  # [T]
        active = torch.nonzero(has_adapter).squeeze(1)  # [T_active]
        order = active[torch.sort(slots[active], stable=True).indices]  # [T_active]
        seg_slots, seg_lens = torch.unique_consecutive(slots[order], return_counts=True)  # [G]
        seg_starts = torch.cumsum(seg_lens, 0) - seg_lens  # [G]
        num_segments = seg_slots.numel()

        packed = torch.cat([order, seg_starts, seg_lens, seg_slots]).to(_INDEX_DTYPE)
        device_packed = _copy_packed(packed, device, staging, device_buffer)
        n_active = order.numel()
        g = num_segments
        return cls(
            token_order=device_packed[:n_active],
            seg_starts=device_packed[n_active : n_active + g],
            seg_lens=device_packed[n_active + g : n_active + 2 * g],
            seg_slots=device_packed[n_active + 2 * g : n_active + 3 * g],
            num_tokens=slots.numel(),
            num_segments=num_segments,
            max_seg_len=int(seg_lens.max()) if g else 0,
            max_rank=int(ranks[seg_slots].max()) if g else 0,
        )

    @classmethod
    def from_device_slots(
        cls,
        token_slots: torch.Tensor,  # [T] int32 on the compute device; -1 = no adapter
        num_slots: int,  # S
        max_rank: int,  # R_max of the slot storage
    ) -> SgmvMetadata:
        """Group tokens by slot on the device, without a host-device sync.

        Used when a kernel is called with `meta=None` on a device tensor. Every slot gets a
        segment (possibly empty) and the grid bounds are the worst case (T tokens, R_max), so the
        kernels launch more programs that exit at once; prefer `from_slots` once per step.
        Out-of-range slot values are not checked here (that would need a sync).
        """
        _check_index("token_slots", token_slots)
        num_tokens = token_slots.numel()
        key = token_slots.to(torch.int64) + 1  # [T]: bin 0 = no adapter, bin s + 1 = slot s
        order = torch.sort(key, stable=True).indices.to(_INDEX_DTYPE)  # [T]
        counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=token_slots.device)
        counts.scatter_add_(0, key, torch.ones_like(key))  # [S + 1]
        starts = torch.cumsum(counts, 0) - counts  # [S + 1]
        return cls(
            token_order=order,
            seg_starts=starts[1:].to(_INDEX_DTYPE),
            seg_lens=counts[1:].to(_INDEX_DTYPE),
            seg_slots=torch.arange(num_slots, dtype=_INDEX_DTYPE, device=token_slots.device),
            num_tokens=num_tokens,
            num_segments=num_slots if num_tokens > 0 else 0,
            max_seg_len=num_tokens,
            max_rank=max_rank,
        )


def _copy_packed(
    packed: torch.Tensor,  # [n] int32 on the host
    device: torch.device,
    staging: torch.Tensor | None,
    device_buffer: torch.Tensor | None,
) -> torch.Tensor:
    n = packed.numel()
    source = packed
    if staging is not None:
        _check_buffer("staging", staging, n, torch.device("cpu"))
        source = staging[:n]
        source.copy_(packed)
    if device_buffer is not None:
        _check_buffer("device_buffer", device_buffer, n, device)
        target = device_buffer[:n]
        target.copy_(source, non_blocking=True)
        return target
    return source.to(device, non_blocking=True)


def _check_index(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 1 or tensor.dtype != _INDEX_DTYPE:
        raise ValueError(
            f"{name} must be a 1-D int32 tensor; got shape {tuple(tensor.shape)}, {tensor.dtype}"
        )


def _check_host_index(name: str, tensor: torch.Tensor) -> None:
    _check_index(name, tensor)
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{name} must be on the host (build metadata from host copies of the step's slots "
            f"and ranks, so no device sync happens); got device {tensor.device}"
        )


def _check_buffer(name: str, buffer: torch.Tensor, needed: int, device: torch.device) -> None:
    if buffer.dim() != 1 or buffer.dtype != _INDEX_DTYPE or not buffer.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D int32 tensor; got {buffer.dtype}")
    if buffer.device.type != device.type or (
        device.index is not None and buffer.device.index != device.index
    ):
        raise ValueError(f"{name} must be on {device}; got {buffer.device}")
    if buffer.numel() < needed:
        raise ValueError(
            f"{name} holds {buffer.numel()} int32 values but this step needs {needed}; "
            f"size it with SgmvMetadata.buffer_capacity(max_tokens, num_slots)"
        )
