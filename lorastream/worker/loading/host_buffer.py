"""One adapter's tensors in one host buffer (pinned on CUDA), written chunk by chunk in place.

The layout and the landing of chunks are :mod:`~lorastream.worker.loading.landing`'s (torch-free,
shared with the fetch process); this class keeps the memory as a torch tensor and hands out the
typed views the device copy reads: per tensor, and grouped so that each (module, A|B) is one
``[layers, r, in]`` block that reaches its slot in ONE copy (:meth:`groups`).
"""

from __future__ import annotations

import numpy as np
import torch

from lorastream.core.adapter_format import parse_lora_key
from lorastream.core.manifest import AdapterManifest
from lorastream.worker.device.device import Device
from lorastream.worker.loading.landing import LandingBuffer
from lorastream.worker.loading.layer_progress import LayersCallback

_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class HostAdapterBuffer(LandingBuffer):
    """A :class:`~lorastream.core.store_client.TensorSink` over one preallocated host buffer;
    ``on_layers(count)`` as the leading layers land, verified (see ``LandingBuffer``)."""

    def __init__(self, device: Device, storage: torch.Tensor | None = None,
                 on_layers: LayersCallback | None = None) -> None:
        super().__init__(on_layers=on_layers)
        self._device = device
        self._host = storage  # [>= nbytes] uint8 to land in (an arena range), else allocated
        self.buffer: torch.Tensor | None = None  # [nbytes] uint8, pinned on CUDA

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def _reserved(self) -> int | None:
        return None if self._host is None else self._host.numel()

    def _take(self, nbytes: int) -> np.ndarray:
        if self._host is None:
            self.buffer = self._device.host_empty(nbytes, torch.uint8)
        else:
            self.buffer = self._host[:nbytes]
        return self.buffer.numpy()

    def adopt(self, manifest: AdapterManifest, landing_seconds: float) -> None:
        """Take the bytes of ``manifest`` as already landed (and verified) in the storage, by
        the fetch process."""
        self.begin(manifest)
        self.landing_seconds = landing_seconds

    # -- typed views for the device copy -----------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """Zero-copy typed views of every tensor, keyed by PEFT name (shapes from the manifest)."""
        assert self.buffer is not None and self.manifest is not None
        views = {}
        for info, start in zip(self.manifest.tensors, self.offsets, strict=True):
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
        buffer, tensors = self.buffer, self.manifest.tensors  # narrowed for close() below
        keyed = []
        for index, info in enumerate(tensors):
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
            info = tensors[index]
            start = self.offsets[index]
            raw = buffer[start : start + info.nbytes * len(run)]
            block = raw.view(_TORCH_DTYPES[info.dtype]).view(len(run), *info.shape)
            blocks.append((module, ab, first, block))
            run.clear()

        for item in keyed:
            module, ab, layer, index = item
            if run:
                p_module, p_ab, p_layer, p_index = run[-1]
                p_info = tensors[p_index]
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
