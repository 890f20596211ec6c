"""The host tier's memory: one buffer of the host budget, carved into per-adapter ranges.

Why one buffer rather than an allocation per fetched adapter:

- on CUDA, pinned memory is slow to allocate and free (``cudaHostAlloc`` pins every page), so
  serving systems allocate it once and reuse it;
- on the CPU, a fresh allocation of this size is a new ``mmap``: every first write faults a page
  in, and the kernel zeroes it. Landing chunks into fresh memory measured 2 GB/s here against
  16 GB/s into memory written before, and the faults take the cores the engine decodes on.

The buffer is allocated once, when the worker starts (or given: the memory the fetch process
shares with the worker, see ``fetch_process.py``, whose pages are all taken at start with
``--host-memory-prefault``); otherwise it is touched only when bytes land in it, so the
process's resident memory grows with the adapters it has held, up to the budget, and stays
there: a range freed by an eviction is written again without a fault.

Ranges are first-fit over a free list ordered by offset, coalesced on free, aligned to 4 KiB. A
range that does not fit contiguously (fragmentation) is reported by :meth:`alloc` as None; the
adapter manager then evicts more idle adapters, or falls back to a separate allocation.
"""

from __future__ import annotations

import bisect
import threading

import torch

from lorastream.worker.device.device import Device

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
