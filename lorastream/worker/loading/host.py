"""The host tier's bytes: the budget, the arena ranges adapters land in, LRU eviction.

An adapter reserves its bytes when its fetch begins (so concurrent fetches never overshoot the
budget) and, for a store fetch, a contiguous range of the :class:`HostArena` to land in. Room is
made by evicting idle host copies, least recently used first. Idle: unpinned, no queued or
running request, not being fetched, and no copy from it into a slot still in flight (the copy
reads the range; overwriting it mid-copy would corrupt the slot).

The adapter manager calls every method here with its lock held.

The host tier's memory: one buffer of the host budget, carved into per-adapter ranges.

Why one buffer rather than an allocation per fetched adapter:

- on CUDA, pinned memory is slow to allocate and free (``cudaHostAlloc`` pins every page), so
  serving systems allocate it once and reuse it;
- on the CPU, a fresh allocation of this size is a new ``mmap``: every first write faults a page
  in, and the kernel zeroes it. Landing chunks into fresh memory is several times slower than
  into memory written before, and the faults take the cores the engine decodes on (measured:
  docs/notes/loading.md, "Host tier").

The buffer is allocated once, when the worker starts (or given: the memory the fetch process
shares with the worker, see ``fetch.py``, whose pages are all taken at start with
``--host-memory-prefault``); otherwise it is touched only when bytes land in it, so the
process's resident memory grows with the adapters it has held, up to the budget, and stays
there: a range freed by an eviction is written again without a fault.

Ranges are first-fit over a free list ordered by offset, coalesced on free, aligned to 4 KiB. A
range that does not fit contiguously (fragmentation) is reported by :meth:`alloc` as None; the
adapter manager then evicts more idle adapters, or falls back to a separate allocation.

One adapter's tensors in one host buffer (pinned on CUDA), written chunk by chunk in place.

The layout and the landing of chunks are :mod:`~lorastream.worker.loading.landing`'s (torch-free,
shared with the fetch process); this class keeps the memory as a torch tensor and hands out the
typed views the device copy reads: per tensor, and grouped so that each (module, A|B) is one
``[layers, r, in]`` block that reaches its slot in ONE copy (:meth:`groups`).
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Iterable

import numpy as np
import torch

from lorastream.core.adapter_format import parse_lora_key, parse_vocab_key
from lorastream.core.manifest import AdapterManifest
from lorastream.worker.device.device import Device
from lorastream.worker.loading.adapter import AdapterEntry
from lorastream.worker.loading.landing import LandingBuffer, LayersCallback
from lorastream.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class HostTier:
    def __init__(self, device: Device, budget: int, metrics: WorkerMetrics,
                 memory: torch.Tensor | None = None) -> None:
        self.budget = budget
        self.arena = HostArena(device, budget, memory)
        self.metrics = metrics

    def reserve(self, entries: Iterable[AdapterEntry], entry: AdapterEntry, need: int,
                *, arena: bool = True) -> bool:
        """Reserve ``need`` bytes for ``entry``, evicting idle host copies as needed.

        With ``arena``, also a range of the arena (``entry.host_offset``); if the free bytes
        suffice but no range is contiguous, evicts further idle copies, and when none is left
        falls back to a separate allocation (``host_offset`` None). False, evicting nothing,
        when the adapters in use leave no room: the caller waits for references to drop.
        """
        entries = list(entries)
        used = sum(e.host_bytes for e in entries)
        idle = sorted(
            (e for e in entries
             if e.weights is not None and e.refs == 0 and not e.pinned and not e.copying),
            key=lambda e: e.last_used,
        )
        if used - sum(e.host_bytes for e in idle) + need > self.budget:
            return False
        offset = None
        while True:
            if used + need <= self.budget:
                offset = self.arena.alloc(need) if arena else None
                if offset is not None or not arena:
                    break
            if not idle:
                log.info("no contiguous host range of %d bytes: allocating it on its own", need)
                break
            victim = idle.pop(0)
            log.info("evicting %s from host memory", victim.name)
            self.metrics.evictions.labels("host").inc()
            used -= victim.host_bytes
            self.drop(victim)
        entry.reserve_host(need, offset)
        return True

    def storage(self, entry: AdapterEntry) -> torch.Tensor | None:
        """``entry``'s arena range to land in, or None (allocate one)."""
        if entry.host_offset is None:
            return None
        return self.arena.view(entry.host_offset, entry.host_bytes)

    def drop(self, entry: AdapterEntry) -> None:
        """Forget ``entry``'s host copy (or reservation) and free its range."""
        if entry.host_offset is not None:
            self.arena.free(entry.host_offset)
        entry.drop_host()


ALIGN = 4096


class HostArena:
    def __init__(self, device: Device, nbytes: int, memory: torch.Tensor | None = None) -> None:
        self.capacity = nbytes // ALIGN * ALIGN
        if memory is not None:
            assert memory.numel() >= self.capacity, "given host memory smaller than the budget"
        # [capacity] uint8, pinned on CUDA; untouched pages cost no resident memory on the CPU.
        self.buffer = (
            device.host_empty(self.capacity, torch.uint8) if memory is None
            else memory[: self.capacity]
        )
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []
        self._used: dict[int, int] = {}  # offset -> size of each allocated range

    @staticmethod
    def rounded(nbytes: int) -> int:
        return -(-nbytes // ALIGN) * ALIGN

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free range of at least ``nbytes``, now allocated; None if none fits."""
        size = self.rounded(max(nbytes, 1))
        with self._lock:
            for index, (start, length) in enumerate(self._free):
                if length >= size:
                    if length == size:
                        del self._free[index]
                    else:
                        self._free[index] = (start + size, length - size)
                    self._used[start] = size
                    return start
        return None

    def free(self, offset: int) -> None:
        """Return the range at ``offset`` to the free list, merged with its free neighbours."""
        with self._lock:
            size = self._used.pop(offset)
            index = bisect.bisect_left(self._free, (offset, 0))
            start, end = offset, offset + size
            if index < len(self._free) and self._free[index][0] == end:  # merge with the next
                end += self._free.pop(index)[1]
            if index > 0 and sum(self._free[index - 1]) == start:  # merge with the previous
                start = self._free[index - 1][0]
                del self._free[index - 1]
                index -= 1
            self._free.insert(index, (start, end - start))

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """``[nbytes]`` uint8 view of the range at ``offset`` (zero-copy)."""
        assert offset in self._used and nbytes <= self._used[offset], "not an allocated range"
        return self.buffer[offset : offset + nbytes]

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(length for _, length in self._free)

    @property
    def largest_free(self) -> int:
        with self._lock:
            return max((length for _, length in self._free), default=0)


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
            vocab = parse_vocab_key(info.name)  # one "layer" block [1, *shape] (lora/vocab.py)
            if vocab is not None:
                keyed.append((vocab.module, vocab.kind, 0, index))
                continue
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
