"""The adapter store's staged contents: the files on disk, their leases, the disk budget and
eviction.

Owns, by content id: the staged adapters under ``cache/adapters`` (through a
:class:`~lorastream.store.staging.Stager`), the leases that keep them on disk (open streams, and a
finished download until each preload sharing it registered its name), and the disk budget: the
bytes staged (kept in ``Registry.sizes``, which the registry's history and ``eviction.py`` read;
only this class writes it, through ``Registry.set_size`` and ``drop_size``) and the estimated
bytes of downloads in progress (reserved).

Eviction works on content ids (``eviction.plan_eviction``): least recently used first, never a
leased id, never one a name pinned, never one the caller protects (the content being committed);
it unbinds the names that point at the evicted content. Content no name and no history refers to
is removed when its last lease closes (:meth:`StagedContents.collect`). At startup
(:meth:`StagedContents.recover`) names whose files are gone lose them, and files no name refers
to are removed. A class of its own so that the store keeps names, watches and downloads, and the
byte accounting has one owner.

Locking: one ``threading.RLock``, the store's, passed in. It guards this class's state (staged,
leases, reserved) together with the store's (the registry's names and history, the downloads in
flight), because an eviction or a collection changes names and files in one step. Methods expect
the caller to hold it, except :meth:`StagedContents.stage` and :meth:`StagedContents.release_locked`
(call them unlocked; they take it themselves) and :meth:`StagedContents.recover` (once, before
serving). No download, validation or tensor read happens under it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from lorastream.core.errors import InvalidAdapter
from lorastream.store.eviction import plan_eviction
from lorastream.store.metrics import StoreMetrics
from lorastream.store.registry import Registry
from lorastream.store.sources.base import AdapterSource, ResolvedSource
from lorastream.store.staging import PhaseCallback, StagedAdapter, Stager

__all__ = ["StagedContents"]

log = logging.getLogger(__name__)


class StagedContents:
    """Staged adapter contents by id, their leases, and the disk budget they live within."""

    def __init__(
        self,
        stager: Stager,
        registry: Registry,
        budget: int,
        lock: threading.RLock,
        metrics: StoreMetrics,
        on_evict: Callable[[str, str], None],
    ) -> None:
        """``on_evict(name, adapter_id)`` is called (lock held) for each name an eviction
        unbinds from its content; the store tells the watches."""
        self.budget = budget
        self._stager = stager
        self._registry = registry
        self._lock = lock
        self._metrics = metrics
        self._on_evict = on_evict
        self._staged: dict[str, StagedAdapter] = {}
        self._leases: dict[str, int] = {}  # adapter_id -> open leases (streams, preloads)
        self._reserved = 0  # estimated bytes of downloads in progress

    # -- startup ----------------------------------------------------------------------------
    def recover(self) -> None:
        """Load staged adapters; drop names without files and files without names (once, at
        startup, before anything else uses the store)."""
        for adapter_id in self._stager.staged_ids():
            try:
                staged = self._stager.load(adapter_id)
            except InvalidAdapter as err:
                log.warning("removing unreadable staged adapter: %s", err)
                self._stager.remove(adapter_id)
                continue
            self._staged[adapter_id] = staged
            self._registry.set_size(adapter_id, staged.size_bytes)
        lost = [e.name for e in self._registry.matching() if e.adapter_id not in self._staged]
        for name in lost:
            log.warning("adapter %s lost its staged files; preload it again", name)
        self._registry.drop_current(lost)
        for adapter_id in list(self._staged):
            if not self._registry.is_referenced(adapter_id):
                log.warning("removing staged adapter %s that no name refers to", adapter_id[:12])
                self._drop_files(adapter_id)
        log.info(
            "adapter store at %s: %d names, %d bytes of %d",
            self._stager.cache_dir, len(self._registry), self._registry.bytes_used, self.budget,
        )

    # -- queries (lock held) ----------------------------------------------------------------
    @property
    def bytes_used(self) -> int:
        return self._registry.bytes_used

    def __len__(self) -> int:
        """Adapter contents on disk (names sharing files count once)."""
        return len(self._staged)

    def __getitem__(self, adapter_id: str) -> StagedAdapter:
        return self._staged[adapter_id]

    # -- leases -----------------------------------------------------------------------------
    def lease(self, adapter_id: str) -> StagedAdapter:
        """Take one lease on ``adapter_id``'s files (lock held); KeyError when not staged."""
        staged = self._staged[adapter_id]
        self._leases[staged.adapter_id] = self._leases.get(staged.adapter_id, 0) + 1
        return staged

    def release_locked(self, adapter_id: str) -> None:
        """:meth:`release`, taking the lock (a stream lease closing)."""
        with self._lock:
            self.release(adapter_id)

    def release(self, adapter_id: str) -> None:
        """Drop one lease on ``adapter_id`` (lock held); its files go if nothing else holds them."""
        self._leases[adapter_id] -= 1
        if self._leases[adapter_id] == 0:
            del self._leases[adapter_id]
        self.collect(adapter_id)

    def collect(self, adapter_id: str) -> None:
        """Remove content no name refers to and no lease holds (lock held)."""
        if (adapter_id in self._staged and not self._leases.get(adapter_id)
                and not self._registry.is_referenced(adapter_id)):
            self._drop_files(adapter_id)

    # -- staging ----------------------------------------------------------------------------
    def stage(
        self,
        source: AdapterSource,
        resolved: ResolvedSource,
        on_phase: PhaseCallback,
        claim: Callable[[], int],
    ) -> StagedAdapter:
        """Reserve room, fetch + validate + hash in a temp dir, commit (call unlocked); the
        staged content comes back holding ``claim()`` leases (called under the lock at commit)."""
        estimate = 0
        try:
            with self._lock:
                self._make_room(resolved.total_bytes, protect=())
                estimate = resolved.total_bytes
                self._reserved += estimate
            prepared = self._metrics.timed_fetch(
                resolved.uri, lambda: self._stager.prepare(source, resolved, on_phase)
            )
            with self._lock:
                self._reserved -= estimate
                estimate = 0
                try:
                    if prepared.adapter_id not in self._staged:
                        self._make_room(prepared.size_bytes, protect=(prepared.adapter_id,))
                    staged, _ = self._stager.commit(prepared)
                finally:
                    self._stager.discard(prepared)
                self._staged[staged.adapter_id] = staged
                self._registry.set_size(staged.adapter_id, staged.size_bytes)
                self._leases[staged.adapter_id] = self._leases.get(staged.adapter_id, 0) + claim()
                return staged
        except BaseException:
            with self._lock:
                self._reserved -= estimate
            raise

    # -- internals (lock held) --------------------------------------------------------------
    def _make_room(self, need: int, protect: tuple[str, ...]) -> None:
        """Evict LRU unpinned, unleased content until ``need`` bytes fit beside reservations."""
        leased = [aid for aid, n in self._leases.items() if n > 0]
        plan = plan_eviction(
            self._registry, need, self.budget - self._reserved, protected=[*leased, *protect]
        )
        if not plan:
            return
        evicted = {aid: self._registry.names_of(aid) for aid in plan}
        self._metrics.evicted(self._registry.sizes.get(aid, 0) for aid in plan)
        self._registry.drop_current(name for names in evicted.values() for name in names)
        for adapter_id, names in evicted.items():
            for name in names:
                self._on_evict(name, adapter_id)
            log.info("evicting %s (%s) to make room", adapter_id[:12], ", ".join(names))
            self._drop_files(adapter_id)

    def _drop_files(self, adapter_id: str) -> None:
        self._staged.pop(adapter_id, None)
        self._registry.drop_size(adapter_id)
        self._stager.remove(adapter_id)
