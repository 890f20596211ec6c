"""Where an adapter's bytes land in host memory, without torch: the layout and the sink.

Imported by the fetch process (``fetch_child``), which must start fast and stay small, and by
:class:`~lorastream.worker.loading.host_buffer.HostAdapterBuffer`, which adds the torch views.

Layout: tensor ``i`` of the manifest starts at ``offsets[i]`` (64-byte aligned so every dtype view
is aligned) inside a single ``uint8`` buffer. Tensors are placed grouped by (module, A|B) in layer
order, not in file order, so that each group -- e.g. lora_A of q_proj for layers 0..29 -- is one
contiguous ``[layers, r, in]`` block that reaches its slot in ONE copy. Example, 2 layers of q_proj
and v_proj::

    file order:   L0.q.A L0.q.B L0.v.A L0.v.B L1.q.A ...
    buffer order: L0.q.A L1.q.A | L0.q.B L1.q.B | L0.v.A L1.v.A | L0.v.B L1.v.B
"""

from __future__ import annotations

import time

import numpy as np

from lorastream.core.adapter_format import parse_lora_key
from lorastream.core.errors import SourceUnavailable
from lorastream.core.manifest import AdapterManifest, TensorInfo
from lorastream.worker.loading.layer_progress import LayerProgress, LayersCallback

ALIGN = 64


def _placement_key(info: TensorInfo) -> tuple[str, str, int, str]:
    key = parse_lora_key(info.name)
    return ("", "", 0, info.name) if key is None else (key.module, key.ab, key.layer, "")


def aligned_offsets(manifest: AdapterManifest) -> tuple[list[int], int]:
    """Offset of each manifest tensor (grouped by (module, A|B), layers ascending, aligned),
    and the bytes the whole buffer takes."""
    offsets = [0] * len(manifest.tensors)
    cursor = 0
    order = sorted(range(len(manifest.tensors)), key=lambda i: _placement_key(manifest.tensors[i]))
    for i in order:
        offsets[i] = cursor
        cursor += (manifest.tensors[i].nbytes + ALIGN - 1) // ALIGN * ALIGN
    return offsets, cursor


def host_nbytes(manifest: AdapterManifest) -> int:
    """Bytes a host buffer for ``manifest`` takes (what the host tier budgets)."""
    return aligned_offsets(manifest)[1]


class LandingBuffer:
    """A :class:`~lorastream.core.store_client.TensorSink`: chunks land at their offset in
    ``storage`` (a ``[>= nbytes]`` uint8 array, e.g. a range of the host arena); no bytes object
    is joined.

    ``on_layers(count)`` is called each time the count of leading layers whose tensors are all
    verified grows (:class:`~lorastream.worker.loading.layer_progress.LayerProgress`).

    Subclasses that keep their memory in another type override :meth:`_reserved` and
    :meth:`_take`.
    """

    def __init__(
        self, storage: np.ndarray | None = None, on_layers: LayersCallback | None = None
    ) -> None:
        self._storage = storage
        self._on_layers = on_layers
        self.manifest: AdapterManifest | None = None
        self.offsets: list[int] = []
        self.progress: LayerProgress | None = None  # with on_layers, from begin()
        self._np: np.ndarray | None = None  # [nbytes] uint8
        self.landing_seconds = 0.0  # time spent in write(), for the landing histogram

    def _reserved(self) -> int | None:
        """Bytes of the storage given, None when there is none."""
        return None if self._storage is None else len(self._storage)

    def _take(self, nbytes: int) -> np.ndarray:
        """The ``[nbytes]`` array to land in: the storage's first bytes, or a new allocation."""
        return np.empty(nbytes, dtype=np.uint8) if self._storage is None else self._storage[:nbytes]

    def begin(self, manifest: AdapterManifest) -> None:
        if self.manifest is not None and self.manifest.adapter_id == manifest.adapter_id:
            return  # a resumed stream of the same content: keep what already landed
        offsets, total = aligned_offsets(manifest)
        reserved = self._reserved()
        if reserved is not None and reserved < total:
            # Reserved for the manifest the fetch began with: the store's copy changed since.
            raise SourceUnavailable(
                f"adapter {manifest.name} changed in the store while it was being fetched (now "
                f"{total} bytes, {reserved} reserved); retry the request"
            )
        self.manifest, self.offsets = manifest, offsets
        self._np = self._take(total)
        if self._on_layers is not None:
            self.progress = LayerProgress(manifest)
            if self.progress.landed:  # leading layers with nothing to land (no or empty tensors)
                self._on_layers(self.progress.landed)

    def write(self, tensor_index: int, offset: int, data: bytes | memoryview) -> None:
        assert self._np is not None
        began = time.perf_counter()
        start = self.offsets[tensor_index] + offset
        self._np[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.landing_seconds += time.perf_counter() - began

    def view(self, tensor_index: int) -> memoryview:
        assert self._np is not None and self.manifest is not None
        start = self.offsets[tensor_index]
        return self._np[start : start + self.manifest.tensors[tensor_index].nbytes].data

    def verified(self, tensor_index: int) -> None:
        if self.progress is None or self._on_layers is None:
            return
        landed = self.progress.verified(tensor_index)
        if landed is not None:
            self._on_layers(landed)


class SlowSink:
    """Wraps a sink and sleeps before each write (the test hook that holds a load in flight)."""

    def __init__(self, inner: LandingBuffer, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s

    def begin(self, manifest: AdapterManifest) -> None:
        self._inner.begin(manifest)

    def write(self, tensor_index: int, offset: int, data: bytes | memoryview) -> None:
        time.sleep(self._delay_s)
        self._inner.write(tensor_index, offset, data)

    def view(self, tensor_index: int) -> memoryview:
        return self._inner.view(tensor_index)

    def verified(self, tensor_index: int) -> None:
        self._inner.verified(tensor_index)
