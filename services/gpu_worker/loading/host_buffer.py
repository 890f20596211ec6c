"""One adapter's tensors in one host buffer (pinned on CUDA), written chunk by chunk in place.

Layout: tensor ``i`` of the manifest starts at ``offsets[i]`` (64-byte aligned so every dtype view
is aligned) inside a single ``uint8`` host tensor. The store's chunks land directly at their offset:
no list of ``bytes`` objects is ever joined.

Tensors are placed grouped by (module, A|B) in layer order, not in file order, so that each
group -- e.g. lora_A of q_proj for layers 0..29 -- is one contiguous ``[layers, r, in]`` block
that reaches its slot in ONE copy (:meth:`groups`). Example, 2 layers of q_proj and v_proj::

    file order:   L0.q.A L0.q.B L0.v.A L0.v.B L1.q.A ...
    buffer order: L0.q.A L1.q.A | L0.q.B L1.q.B | L0.v.A L1.v.A | L0.v.B L1.v.B
"""

from __future__ import annotations

import time

import numpy as np
import torch

from lorastream.adapter_format import parse_lora_key
from lorastream.errors import SourceUnavailable
from lorastream.manifest import AdapterManifest, TensorInfo
from services.gpu_worker.device import Device

ALIGN = 64
_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _placement_key(info: TensorInfo) -> tuple[str, str, int, str]:
    key = parse_lora_key(info.name)
    return ("", "", 0, info.name) if key is None else (key.module, key.ab, key.layer, "")


def _aligned_offsets(manifest: AdapterManifest) -> tuple[list[int], int]:
    """Offset of each manifest tensor: grouped by (module, A|B), layers ascending, aligned."""
    offsets = [0] * len(manifest.tensors)
    cursor = 0
    order = sorted(range(len(manifest.tensors)), key=lambda i: _placement_key(manifest.tensors[i]))
    for i in order:
        offsets[i] = cursor
        cursor += (manifest.tensors[i].nbytes + ALIGN - 1) // ALIGN * ALIGN
    return offsets, cursor


def host_nbytes(manifest: AdapterManifest) -> int:
    """Bytes a host buffer for ``manifest`` takes (what the host tier budgets)."""
    return _aligned_offsets(manifest)[1]


class HostAdapterBuffer:
    """A :class:`~lorastream.store_client.TensorSink` over one preallocated host buffer."""

    def __init__(self, device: Device, storage: torch.Tensor | None = None) -> None:
        self._device = device
        self._storage = storage  # [>= nbytes] uint8 to land in (an arena range), else allocated
        self.manifest: AdapterManifest | None = None
        self.offsets: list[int] = []
        self.buffer: torch.Tensor | None = None  # [nbytes] uint8, pinned on CUDA
        self._np: np.ndarray | None = None  # numpy view of the same memory
        self.landing_seconds = 0.0  # time spent in write(), for the landing histogram

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    # -- TensorSink ------------------------------------------------------------------------
    def begin(self, manifest: AdapterManifest) -> None:
        if self.manifest is not None and self.manifest.adapter_id == manifest.adapter_id:
            return  # a resumed stream of the same content: keep what already landed
        self.manifest = manifest
        self.offsets, total = _aligned_offsets(manifest)
        if self._storage is None:
            self.buffer = self._device.host_empty(total, torch.uint8)
        elif self._storage.numel() >= total:
            self.buffer = self._storage[:total]
        else:  # reserved for the manifest the fetch began with: the store's copy changed since
            raise SourceUnavailable(
                f"adapter {manifest.name} changed in the store while it was being fetched (now "
                f"{total} bytes, {self._storage.numel()} reserved); retry the request"
            )
        self._np = self.buffer.numpy()

    def write(self, tensor_index: int, offset: int, data: bytes | memoryview) -> None:
        assert self._np is not None
        began = time.perf_counter()
        start = self.offsets[tensor_index] + offset
        self._np[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.landing_seconds += time.perf_counter() - began

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

    def groups(self) -> list[tuple[str, str, int, torch.Tensor]]:
        """The adapter as few blocks as possible: ``(module, "A"|"B", first layer, block)``.

        ``block`` is ``[n, *shape]``: n consecutive layers of one module's A or B, contiguous
        in the buffer (a zero-copy view). A group breaks where a layer is missing or a tensor's
        size is not a multiple of the alignment.
        """
        assert self.buffer is not None and self.manifest is not None
        keyed = []
        for index, info in enumerate(self.manifest.tensors):
            key = parse_lora_key(info.name)
            if key is None:
                raise ValueError(f"{info.name} is not a LoRA A/B weight")
            keyed.append((key.module, key.ab, key.layer, index))
        keyed.sort()
        blocks: list[tuple[str, str, int, torch.Tensor]] = []
        run: list[tuple[str, str, int, int]] = []

        def close() -> None:
            if not run:
                return
            module, ab, first, index = run[0]
            info = self.manifest.tensors[index]  # type: ignore[union-attr]
            start = self.offsets[index]
            raw = self.buffer[start : start + info.nbytes * len(run)]  # type: ignore[index]
            block = raw.view(_TORCH_DTYPES[info.dtype]).view(len(run), *info.shape)
            blocks.append((module, ab, first, block))
            run.clear()

        for item in keyed:
            module, ab, layer, index = item
            if run:
                p_module, p_ab, p_layer, p_index = run[-1]
                p_info = self.manifest.tensors[p_index]
                contiguous = (
                    (module, ab, layer) == (p_module, p_ab, p_layer + 1)
                    and self.offsets[index] == self.offsets[p_index] + p_info.nbytes
                    and self.manifest.tensors[index].shape == p_info.shape
                    and self.manifest.tensors[index].dtype == p_info.dtype
                )
                if not contiguous:
                    close()
            run.append(item)
        close()
        return blocks
