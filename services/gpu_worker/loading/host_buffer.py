"""One adapter's tensors in one host buffer (pinned on CUDA), written chunk by chunk in place.

Layout: tensor ``i`` of the manifest starts at ``offsets[i]`` (64-byte aligned so every dtype view
is aligned) inside a single ``uint8`` host tensor. The store's chunks land directly at their offset:
no list of ``bytes`` objects is ever joined.
"""

from __future__ import annotations

import numpy as np
import torch

from lorastream.manifest import AdapterManifest
from services.gpu_worker.device import Device

ALIGN = 64
_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _aligned_offsets(manifest: AdapterManifest) -> tuple[list[int], int]:
    offsets, cursor = [], 0
    for info in manifest.tensors:
        offsets.append(cursor)
        cursor += (info.nbytes + ALIGN - 1) // ALIGN * ALIGN
    return offsets, cursor


def host_nbytes(manifest: AdapterManifest) -> int:
    """Bytes a host buffer for ``manifest`` takes (what the host tier budgets)."""
    return _aligned_offsets(manifest)[1]


class HostAdapterBuffer:
    """A :class:`~lorastream.store_client.TensorSink` over one preallocated host buffer."""

    def __init__(self, device: Device) -> None:
        self._device = device
        self.manifest: AdapterManifest | None = None
        self.offsets: list[int] = []
        self.buffer: torch.Tensor | None = None  # [nbytes] uint8, pinned on CUDA
        self._np: np.ndarray | None = None  # numpy view of the same memory

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    # -- TensorSink ------------------------------------------------------------------------
    def begin(self, manifest: AdapterManifest) -> None:
        if self.manifest is not None and self.manifest.adapter_id == manifest.adapter_id:
            return  # a resumed stream of the same content: keep what already landed
        self.manifest = manifest
        self.offsets, total = _aligned_offsets(manifest)
        self.buffer = self._device.host_empty(total, torch.uint8)
        self._np = self.buffer.numpy()

    def write(self, tensor_index: int, offset: int, data: bytes | memoryview) -> None:
        assert self._np is not None
        start = self.offsets[tensor_index] + offset
        self._np[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def view(self, tensor_index: int) -> memoryview:
        assert self._np is not None and self.manifest is not None
        start = self.offsets[tensor_index]
        return memoryview(self._np[start : start + self.manifest.tensors[tensor_index].nbytes])

    # -- typed views for the device copy -----------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """Zero-copy typed views of every tensor, keyed by PEFT name (shapes from the manifest)."""
        assert self.buffer is not None and self.manifest is not None
        views = {}
        for info, start in zip(self.manifest.tensors, self.offsets):
            raw = self.buffer[start : start + info.nbytes]
            views[info.name] = raw.view(_TORCH_DTYPES[info.dtype]).view(info.shape)
        return views
