"""Preallocated staging for the per-step metadata (docs/design.md rule 3).

Every small tensor a step needs (token ids, positions, cache slots, block tables, LoRA layout
rows, scales) is written into one host buffer -- pinned on CUDA -- and reaches the device in ONE
``non_blocking`` copy into a device buffer of fixed address (so a CUDA graph could capture the
decode step). Two arenas alternate: arena ``k`` is refilled two steps later, after waiting on the
event recorded when its copy was issued (it has long completed: a step is in between).

On the CPU the host buffer *is* the device buffer; ``flush`` does nothing.

Usage, per step::

    arena = staging.next()
    ids = arena.longs([5, 9, 33])          # device views, valid once flushed
    table = arena.longs_2d([[7, 2], [4, 0]])
    arena.flush()                          # one H2D copy
"""

from __future__ import annotations

import logging

import torch

from lorastream.worker.device.device import COMPLETED, Device, Event

log = logging.getLogger(__name__)


class Arena:
    def __init__(self, device: Device, capacity: int) -> None:
        self._device = device
        self._cuda = device.is_cuda
        self._capacity = 0
        self._cursor_l = self._cursor_f = 0
        self._event: Event = COMPLETED
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self._capacity = capacity
        self._host_l = self._device.host_empty(capacity, torch.int64)  # pinned on CUDA
        self._host_f = self._device.host_empty(capacity, torch.float32)
        self._np_l = self._host_l.numpy()
        self._np_f = self._host_f.numpy()
        if self._cuda:  # pragma: no cover - needs a GPU
            self._dev_l = torch.empty(capacity, dtype=torch.int64, device=self._device.device)
            self._dev_f = torch.empty(capacity, dtype=torch.float32, device=self._device.device)
        else:
            self._dev_l, self._dev_f = self._host_l, self._host_f

    def begin(self, need: int) -> None:
        """Wait until this arena's previous copy finished; grow it if ``need`` does not fit."""
        self._event.wait()
        if need > self._capacity:
            log.info("step staging grows from %d to %d entries", self._capacity, need)
            self._allocate(max(need, 2 * self._capacity))
        self._cursor_l = self._cursor_f = 0

    def longs(self, values: list[int]) -> torch.Tensor:
        n, c = len(values), self._cursor_l
        if c + n > self._capacity:
            raise RuntimeError("step staging overflow: begin() was given too small a size")
        self._np_l[c : c + n] = values
        self._cursor_l = c + n
        return self._dev_l[c : c + n]

    def longs_2d(self, rows: list[list[int]], width: int) -> torch.Tensor:
        flat = [v for row in rows for v in row]
        return self.longs(flat).view(len(rows), width)

    def floats(self, values: list[float]) -> torch.Tensor:
        n, c = len(values), self._cursor_f
        if c + n > self._capacity:
            raise RuntimeError("step staging overflow: begin() was given too small a size")
        self._np_f[c : c + n] = values
        self._cursor_f = c + n
        return self._dev_f[c : c + n]

    def flush(self) -> None:
        """Copy what was staged to the device in one non-blocking transfer per dtype."""
        if not self._cuda:
            return
        cl, cf = self._cursor_l, self._cursor_f  # pragma: no cover - needs a GPU
        if cl:  # pragma: no cover
            self._dev_l[:cl].copy_(self._host_l[:cl], non_blocking=True)
        if cf:  # pragma: no cover
            self._dev_f[:cf].copy_(self._host_f[:cf], non_blocking=True)
        self._event = self._device.record_compute()  # pragma: no cover


class StepStaging:
    """Two arenas used alternately, one per step."""

    def __init__(self, device: Device, capacity: int) -> None:
        self._arenas = (Arena(device, capacity), Arena(device, capacity))
        self._turn = 0

    def next(self, need: int) -> Arena:
        arena = self._arenas[self._turn]
        self._turn ^= 1
        arena.begin(need)
        return arena

