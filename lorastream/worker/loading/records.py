"""The adapter manager's records: which adapters this worker holds and the names they go by.

Adapters are keyed by content id; names (``name`` or ``name@<content-id prefix>``) map to ids,
several names to one id when they share their files. This class is the one owner of both maps and
of the pins that follow a name to its next content. Every method takes the manager's lock (a
re-entrant one: the manager calls them inside its own critical sections too), so the name
resolver, which must call the store between its look-ups, sees each one whole.

Example: ``french`` is registered at content ``c1`` and pinned; the store moves ``french`` to
``c2``: :meth:`unbind_moved` drops ``french -> c1`` and, no other name holding ``c1``, moves the
pin to the name; the next :meth:`add` of ``french`` (content ``c2``) pins ``c2``.
"""

from __future__ import annotations

import threading
from collections.abc import ValuesView

from lorastream.core.errors import AdapterNotFound
from lorastream.core.generation import AdapterStatus
from lorastream.core.manifest import AdapterManifest
from lorastream.core.versions import parse_ref
from lorastream.worker.loading.entry import AdapterEntry
from lorastream.worker.loading.status import (
    AdapterSnapshot,
    TierUsage,
    adapter_status,
    adapter_statuses,
    snapshot,
    tier_usage,
)


class AdapterRecords:
    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock  # the manager's
        self._entries: dict[str, AdapterEntry] = {}  # adapter_id -> entry
        self._names: dict[str, str] = {}  # name -> adapter_id
        self._pin_next: set[str] = set()  # names whose next content inherits a pin

    # -- reads --------------------------------------------------------------------------------
    def get(self, adapter_id: str) -> AdapterEntry | None:
        with self._lock:
            return self._entries.get(adapter_id)

    def named(self, name: str) -> AdapterEntry | None:
        """The entry ``name`` maps to, if any."""
        with self._lock:
            return self._entries.get(self._names.get(name, ""))

    def entries(self) -> ValuesView[AdapterEntry]:
        """Every entry (a live view: iterate it with the lock held)."""
        return self._entries.values()

    def names_of(self, adapter_id: str) -> list[str]:
        """The names that map to ``adapter_id``, sorted."""
        with self._lock:
            return sorted(n for n, held in self._names.items() if held == adapter_id)

    def status(self, name: str) -> AdapterStatus:
        with self._lock:
            entry = self.named(name)
            if entry is None:
                raise AdapterNotFound(f"adapter {name!r} is not loaded on this worker")
            return adapter_status(name, entry)

    def statuses(self) -> list[AdapterStatus]:
        with self._lock:
            return adapter_statuses(self._entries.values(), self.names_of)

    def usage(self, host_budget: int) -> TierUsage:
        with self._lock:
            return tier_usage(self._entries.values(), host_budget)

    def inspect(self, name: str) -> AdapterSnapshot | None:
        with self._lock:
            entry = self.named(name)
            return None if entry is None else snapshot(entry)

    # -- changes ------------------------------------------------------------------------------
    def keep(self, name: str, entry: AdapterEntry) -> None:
        """Hold ``entry`` (if not held yet) and map ``name`` to it."""
        with self._lock:
            self._entries.setdefault(entry.adapter_id, entry)
            self._names[name] = entry.adapter_id

    def bind(self, name: str, adapter_id: str) -> AdapterEntry | None:
        """Map ``name`` to the held entry of ``adapter_id``; None (nothing mapped) if not held."""
        with self._lock:
            entry = self._entries.get(adapter_id)
            if entry is not None:
                self._names[name] = adapter_id
            return entry

    def add(self, ref: str, manifest: AdapterManifest) -> AdapterEntry:
        """The entry of ``manifest``'s content (new ones are named ``ref``), ``ref`` mapped to
        it; pinned if a pin waits for the name's next content."""
        with self._lock:
            entry = self._entries.get(manifest.adapter_id)
            if entry is None:
                entry = self._entries[manifest.adapter_id] = AdapterEntry(
                    manifest.adapter_id, ref, manifest
                )
            self._names[ref] = manifest.adapter_id
            name = parse_ref(ref).name
            if name in self._pin_next and not parse_ref(ref).pinned:
                self._pin_next.discard(name)
                entry.pin()
            return entry

    def unbind_moved(self, name: str, adapter_id: str) -> None:
        """The store's ``name`` now points at ``adapter_id``: drop the mapping of ``name`` to
        other content (not a local registration's); a pin held only through it waits for the
        name's next content."""
        with self._lock:
            old = self._names.get(name)
            entry = self._entries.get(old or "")
            if old is None or old == adapter_id or (entry and entry.local_path is not None):
                return
            del self._names[name]
            if entry is not None and entry.pinned and old not in self._names.values():
                entry.unpin()
                self._pin_next.add(name)

    def unname(self, name: str) -> None:
        """Forget ``name``; the entry it mapped to goes too once no name maps to it (else it
        is fetched by one of its other names from now on)."""
        with self._lock:
            adapter_id = self._names.pop(name)
            others = [n for n, held in self._names.items() if held == adapter_id]
            entry = self._entries[adapter_id]
            if not others:
                del self._entries[adapter_id]
            elif entry.name == name:  # a refetch asks the store by a name it still knows
                entry.rename(others[0])
