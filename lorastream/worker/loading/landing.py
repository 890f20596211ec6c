"""Where an adapter's bytes land in host memory, without torch: the layout and the sink.

Imported by the fetch process (``fetch_child``), which must start fast and stay small, and by
:class:`~lorastream.worker.loading.host.HostAdapterBuffer`, which adds the torch views.

Layout: tensor ``i`` of the manifest starts at ``offsets[i]`` (64-byte aligned so every dtype view
is aligned) inside a single ``uint8`` buffer. Tensors are placed grouped by (module, A|B) in layer
order, not in file order, so that each group -- e.g. lora_A of q_proj for layers 0..29 -- is one
contiguous ``[layers, r, in]`` block that reaches its slot in ONE copy. Example, 2 layers of q_proj
and v_proj::

    file order:   L0.q.A L0.q.B L0.v.A L0.v.B L1.q.A ...
    buffer order: L0.q.A L1.q.A | L0.q.B L1.q.B | L0.v.A L1.v.A | L0.v.B L1.v.B

How many of an adapter's leading layers have landed, verified, as its tensors arrive.

The store streams a manifest's tensors in layer order (``adapter_validation.layer_order``), so a
receiver holds layer 0 whole first, then layer 1, and so on; a cold request's prefill may run the
layers that have landed while the later ones still arrive. The receiver tells a
:class:`LayerProgress` each tensor whose digest it verified; it answers with the count of
*leading* layers all of whose tensors are verified, each time that count grows.

No torch here: the fetch process (``fetch_child``) imports it and must start fast.

The layers are the manifest's own: ``n = 1 + the highest layer any tensor names`` (the base
model's depth is not known in the fetch process). A layer no tensor names (an adapter of layers
0 and 2 only) counts as complete. Tensors of no layer complete only with the whole adapter: the
count stops at ``n - 1`` until they are verified too. Empty tensors take no bytes, land nothing
and are never verified by the stream, so they count as verified from the start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lorastream.core.adapter_format import parse_lora_key
from lorastream.core.errors import SourceUnavailable
from lorastream.core.manifest import AdapterManifest, TensorInfo

ALIGN = 64


@dataclass
class FetchTimes:
    """Where one store fetch's time went, wall clock against CPU time, in seconds (picklable: the
    fetch process sends it back with the manifest).

    ``cpu_s`` is the fetch process's CPU over the fetch (all its threads: gRPC's receive path
    included; one fetch at a time by default, so it is this fetch's), or without a fetch process
    the CPU of the thread that ran the stream (gRPC's own threads not counted). Landing and
    checksums are timed on the thread that receives the chunks (``time.thread_time``); what is
    left of the fetch is the store stream: socket reads, message parsing, waiting for the link.
    """

    wall_s: float = 0.0  # the whole stream, request to last tensor verified
    cpu_s: float = 0.0
    landing_s: float = 0.0  # writing chunks at their offsets in host memory
    landing_cpu_s: float = 0.0
    checksum_s: float = 0.0  # checking each tensor's digest once its last byte landed
    checksum_cpu_s: float = 0.0


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
    verified grows (:class:`~lorastream.worker.loading.landing.LayerProgress`).

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
        self.times = FetchTimes()  # landing and checksums timed here; the fetch fills the rest
        self._checking: tuple[float, float] | None = None  # (wall, thread CPU) when view() began

    @property
    def landing_seconds(self) -> float:
        """Time spent in write(), for the landing histogram."""
        return self.times.landing_s

    @landing_seconds.setter
    def landing_seconds(self, seconds: float) -> None:
        self.times.landing_s = seconds

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
        began, cpu = time.perf_counter(), time.thread_time()
        start = self.offsets[tensor_index] + offset
        self._np[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.times.landing_s += time.perf_counter() - began
        self.times.landing_cpu_s += time.thread_time() - cpu

    def view(self, tensor_index: int) -> memoryview:
        """The bytes of tensor ``tensor_index``. The receiver asks for them to check their
        digest and then calls :meth:`verified`: the time between the two is the checksum's."""
        assert self._np is not None and self.manifest is not None
        self._checking = (time.perf_counter(), time.thread_time())
        start = self.offsets[tensor_index]
        return self._np[start : start + self.manifest.tensors[tensor_index].nbytes].data

    def verified(self, tensor_index: int) -> None:
        if self._checking is not None:
            began, cpu = self._checking
            self.times.checksum_s += time.perf_counter() - began
            self.times.checksum_cpu_s += time.thread_time() - cpu
            self._checking = None
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


LayersCallback = Callable[[int], None]  # called with the count of leading layers now landed


def manifest_layers(manifest: AdapterManifest) -> int:
    """Layers of ``manifest``: 1 + the highest layer a tensor names, 0 if none names one."""
    layers = [key.layer for t in manifest.tensors if (key := parse_lora_key(t.name)) is not None]
    return 1 + max(layers) if layers else 0


class LayerProgress:
    """The leading layers of one manifest whose tensors are all verified.

    Example: 3 layers, streamed in an old file-ordered manifest (layer 2 before layer 1)::

        tensors: 0: L0.A  1: L0.B  2: L2.A  3: L2.B  4: L1.A  5: L1.B
        verified(0) -> None   verified(1) -> 1     (layer 0 whole)
        verified(2) -> None   verified(3) -> None  (layer 2 whole, but layer 1 is not)
        verified(4) -> None   verified(5) -> 3     (layers 1 and 2: 3 leading layers)
        verified(5) -> None                        (again: nothing changes)
    """

    def __init__(self, manifest: AdapterManifest) -> None:
        self.layers = manifest_layers(manifest)
        self.landed = 0  # leading layers complete
        self._layer_of: list[int] = []  # tensor index -> layer, self.layers: of no layer
        self._pending = [0] * (self.layers + 1)  # per layer (then: of no layer), unverified
        self._verified = [t.nbytes == 0 for t in manifest.tensors]
        for info, done in zip(manifest.tensors, self._verified, strict=True):
            key = parse_lora_key(info.name)
            layer = self.layers if key is None else key.layer
            self._layer_of.append(layer)
            self._pending[layer] += not done
        self._advance()

    def verified(self, tensor_index: int) -> int | None:
        """Mark tensor ``tensor_index`` verified; the new count of leading complete layers when
        it grew, else None (also for a tensor marked before)."""
        if self._verified[tensor_index]:
            return None
        self._verified[tensor_index] = True
        self._pending[self._layer_of[tensor_index]] -= 1
        before = self.landed
        self._advance()
        return self.landed if self.landed > before else None

    def _advance(self) -> None:
        while self.landed < self.layers and not self._pending[self.landed]:
            if self.landed == self.layers - 1 and self._pending[self.layers]:
                return  # the last layer waits for the tensors of no layer
            self.landed += 1
