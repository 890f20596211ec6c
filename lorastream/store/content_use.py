"""What the disk budget reads about each staged content id, kept in memory as it changes.

Per staged content id: its bytes on disk, its latest use (among the names and versions that hold
it) and whether a name pointing at it now is pinned; plus the total bytes and the least recently
used order eviction follows. Each is kept up to date by the change that moves it, so that a
registration costs the same whatever the number of names: nothing here is recomputed over every
content id (the earlier eviction grouped every name and version in SQLite on each staging, and
summed every size: a preload at 2,000 names took 3x one at 400).

The LRU order is a heap of ``(last use, content id)`` with lazy deletion: a change pushes the
new pair and leaves the old one in place; a pair that no longer matches the content's current
use (or whose content is pinned or gone) is dropped when it comes to the top. When stale pairs
outnumber the live ones the heap is rebuilt (amortised O(1) per change).

Example: a (used 5), b (used 3), c (used 9, pinned). ``take(need=2 sizes)`` yields b, then a;
c is never a candidate. b is used at 12: the pair (12, b) is pushed, (3, b) is dropped when it
surfaces, and the order is a, b.

Not thread-safe: the registry (its only user) is called under the store's lock.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterator, Mapping

__all__ = ["ContentUse"]

_REBUILD_SLACK = 64  # stale heap pairs tolerated beyond the live ones before a rebuild


class ContentUse(Mapping[str, int]):
    """content id -> bytes on disk for every staged content, with each one's last use and pin
    state, and the LRU order of the evictable ones. Reads as a mapping of the sizes."""

    def __init__(self) -> None:
        self._sizes: dict[str, int] = {}
        self._use: dict[str, tuple[float, bool]] = {}  # content id -> (last use, pinned)
        self._heap: list[tuple[float, str]] = []  # (last use, content id), unpinned, lazily
        self.bytes_used = 0

    # -- the mapping: sizes of the staged contents ----------------------------------------------
    def __getitem__(self, adapter_id: str) -> int:
        return self._sizes[adapter_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sizes)

    def __len__(self) -> int:
        return len(self._sizes)

    # -- changes --------------------------------------------------------------------------------
    def staged(self, adapter_id: str, size: int, used: float, pinned: bool) -> None:
        """``adapter_id`` is on disk with ``size`` bytes (new, or measured again)."""
        self.bytes_used += size - self._sizes.get(adapter_id, 0)
        self._sizes[adapter_id] = size
        self._use.pop(adapter_id, None)  # so that use() pushes its pair whatever it was
        self.use(adapter_id, used, pinned)

    def gone(self, adapter_id: str) -> None:
        """``adapter_id``'s files are gone (evicted, collected, unreadable)."""
        self.bytes_used -= self._sizes.pop(adapter_id, 0)
        self._use.pop(adapter_id, None)  # its heap pairs are stale from now on

    def use(self, adapter_id: str, used: float, pinned: bool) -> None:
        """``adapter_id``'s latest use and pin state now (ignored unless it is staged)."""
        if adapter_id not in self._sizes or self._use.get(adapter_id) == (used, pinned):
            return
        self._use[adapter_id] = (used, pinned)
        if not pinned:
            heapq.heappush(self._heap, (used, adapter_id))
            if len(self._heap) > 2 * len(self._use) + _REBUILD_SLACK:
                self._rebuild()

    # -- queries --------------------------------------------------------------------------------
    def last_use(self, adapter_id: str) -> tuple[float, bool]:
        """(latest use, pinned) of a staged content id."""
        return self._use[adapter_id]

    def take(self, need: int, protected: Collection[str]) -> tuple[list[str], int]:
        """Evictable content ids, least recently used first, until their bytes reach ``need``
        (or none is left): the ids and their bytes. Nothing changes; pinned and ``protected``
        ids are skipped. Costs O((taken + protected + stale) log n)."""
        taken: list[str] = []
        freed = 0
        popped: list[tuple[float, str]] = []
        try:
            while freed < need and self._heap:
                used, adapter_id = heapq.heappop(self._heap)
                pair = (used, adapter_id)
                if self._use.get(adapter_id) != (used, False) or popped[-1:] == [pair]:
                    continue  # stale (a newer pair stands for it, or pinned, or gone) or twice
                popped.append(pair)
                if adapter_id in protected:
                    continue
                taken.append(adapter_id)
                freed += self._sizes[adapter_id]
        finally:
            for pair in popped:  # only read: put back the live pairs (taken ones go stale later)
                heapq.heappush(self._heap, pair)
        return taken, freed

    def order(self, protected: Collection[str] = ()) -> list[str]:
        """Every evictable content id, least recently used first (O(n log n): tests, reports)."""
        return sorted(
            (aid for aid, (_, pinned) in self._use.items() if not pinned and aid not in protected),
            key=lambda aid: (self._use[aid][0], aid),
        )

    # -- internals ------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        self._heap = [(used, aid) for aid, (used, pinned) in self._use.items() if not pinned]
        heapq.heapify(self._heap)
