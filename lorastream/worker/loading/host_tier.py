"""The host tier's bytes: the budget, the arena ranges adapters land in, LRU eviction.

An adapter reserves its bytes when its fetch begins (so concurrent fetches never overshoot the
budget) and, for a store fetch, a contiguous range of the :class:`HostArena` to land in. Room is
made by evicting idle host copies, least recently used first. Idle: unpinned, no queued or
running request, not being fetched, and no copy from it into a slot still in flight (the copy
reads the range; overwriting it mid-copy would corrupt the slot).

The adapter manager calls every method here with its lock held.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from lorastream.worker.device.device import Device
from lorastream.worker.loading.entry import AdapterEntry
from lorastream.worker.loading.host_arena import HostArena
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
