"""Names to content ids on the request path: the adapter manager's resolver.

A request names ``name`` (the store's current version) or ``name@<content-id prefix>`` (one
version). The resolver answers from, in order:

1. a local registration (LoadAdapter from a path) under that name;
2. the store's catalogue (``names.py``) when it is live: the name's content id, then the
   entry this worker holds for it: no store call for a resident adapter. A content id this worker
   does not hold yet costs one DescribeAdapter (its manifest), as a cold adapter's fetch will;
3. when the store is down: the entry this worker last resolved the name to (resident adapters
   keep serving), or a clear error for the others;
4. otherwise (catalogue syncing): DescribeAdapter, falling back to the held entry when the store
   cannot be reached.

When the catalogue reports that a name moved to other content, this worker's mapping of the name
to the old content is dropped, and a pin held through it moves to the name's next content.
``name@prefix`` mappings stay: a version's content never changes.

The worker's copy of the store's catalogue (name -> current content id), kept by a watch.

A background thread holds a ``WatchAdapters`` stream (docs/store-api.md, "Watch"): the snapshot
fills the catalogue, each change updates it, then the change is acknowledged (the store holds a
push's reply until its watchers acknowledged it: once a push is acknowledged, this worker resolves
the name to the new content). Requests resolve names here, with no store call.

States, as :meth:`StoreCatalogue.lookup` reports them:

- ``LIVE``: the snapshot is applied and the store was heard from within ``stale_after_s`` (it
  sends a heartbeat every 0.5 s): the catalogue is the truth.
- ``DOWN``: the store cannot be reached: serve what this worker holds, fail the rest clearly.
- ``SYNCING``: anything else (starting, reconnecting, dropped for acknowledging late, silent
  connection): the catalogue may be stale, so ask the store (DescribeAdapter).

The watch reconnects after a failure with exponential backoff from ``backoff_s`` capped at
``backoff_max_s``; the channel's own reconnect backoff is capped alike (``store_client.py``).

The adapter manager's records: which adapters this worker holds and the names they go by.

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

import enum
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, ValuesView
from dataclasses import dataclass

from lorastream.core.errors import AdapterNotFound, LorastreamError, SourceUnavailable
from lorastream.core.generation import AdapterStatus
from lorastream.core.manifest import AdapterManifest
from lorastream.core.store_client import AdapterWatch, StoreClient
from lorastream.core.versions import ChangeKind, WatchMessage, parse_ref, pinned_ref
from lorastream.worker.loading.adapter import (
    AdapterEntry,
    AdapterSnapshot,
    TierUsage,
    adapter_status,
    adapter_statuses,
    check_fits,
    snapshot,
    tier_usage,
)
from lorastream.worker.loading.fetch import AdapterFetcher
from lorastream.worker.lora.vocab import VocabBudget
from lorastream.worker.model.config import ModelConfig

log = logging.getLogger(__name__)


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


class NameResolver:
    """Resolves references to the entries of the manager's :class:`AdapterRecords`."""

    def __init__(
        self, records: AdapterRecords, fetcher: AdapterFetcher, config: ModelConfig,
        max_rank: int, vocab_budget: VocabBudget | None = None,
    ) -> None:
        self._records = records
        self._fetcher = fetcher
        self._config = config
        self._max_rank = max_rank
        self._vocab_budget = vocab_budget
        client = fetcher.client
        self.catalogue = StoreCatalogue(client, self.forget) if client is not None else None
        if self.catalogue is not None:
            self.catalogue.start()

    def close(self) -> None:
        if self.catalogue is not None:
            self.catalogue.close()

    def resolve(self, ref: str) -> AdapterEntry:
        """The entry ``ref`` stands for (see the module docstring for where the answer comes
        from). Raises AdapterNotFound, SourceUnavailable (store down, adapter not held here) and
        the store's errors."""
        known = self._records.named(ref)
        if known is not None and known.local_path is not None:
            return known
        if self.catalogue is None:
            if known is not None:
                return known
            raise AdapterNotFound(
                f"unknown model {ref!r}: not the base model and not an adapter loaded on this "
                "worker (the worker has no --store to look it up)"
            )
        lookup = self.catalogue.lookup(ref)
        if lookup.state is CatalogueState.DOWN:
            if known is not None:
                return known
            try:  # the store may be back before the watch is: one try, failing fast
                return self._describe(ref, ref)
            except SourceUnavailable as err:
                since = time.strftime("%H:%M:%S", time.gmtime(lookup.down_since))
                raise SourceUnavailable(
                    f"adapter {ref} is not held on this worker and the adapter store has been "
                    f"unreachable since {since} UTC: adapters in this worker's memory keep "
                    "serving, others fail until the store is back"
                ) from err
        if lookup.state is CatalogueState.LIVE:
            if lookup.adapter_id is not None:
                entry = self._records.bind(ref, lookup.adapter_id)
                if entry is not None:
                    return entry
                return self._describe(ref, pinned_ref(ref, lookup.adapter_id))
            if not parse_ref(ref).pinned:
                raise AdapterNotFound(
                    f"unknown model {ref!r}: not the base model and not an adapter in the store "
                    "('lorastream adapters ls' lists them)"
                )
            if known is not None:  # an older version resolved before: its content is fixed
                return known
        try:
            return self._describe(ref, ref)
        except SourceUnavailable:
            if known is None:
                raise
            log.warning("store unreachable; serving %s from this worker's copy", ref)
            return known

    def forget(self, name: str, adapter_id: str | None) -> None:
        """The store's ``name`` now points at ``adapter_id`` (None: deleted). When it moved to
        other content, drop this worker's mapping of ``name`` to the old one (unless a local
        registration); a pin held only through it waits for the name's next content. A deleted
        name keeps its mapping: requests for it are refused while the catalogue is live, and an
        operator can still unload what this worker holds under it."""
        if adapter_id is not None:
            self._records.unbind_moved(name, adapter_id)

    def _describe(self, ref: str, query: str) -> AdapterEntry:
        """Ask the store for ``query``'s manifest; the entry ``ref`` now maps to."""
        manifest = self._fetcher.describe(query)
        check_fits(manifest, self._config, self._max_rank, self._vocab_budget)
        return self._records.add(ref, manifest)


class CatalogueState(enum.Enum):
    SYNCING = "syncing"
    LIVE = "live"
    DOWN = "down"


@dataclass(frozen=True)
class Lookup:
    """What the catalogue says about a reference: its state, and (LIVE) the name's current
    content id, or None when the store has no such name. For ``name@prefix``: the current id only
    when it starts with the prefix (older versions are not in the catalogue)."""

    state: CatalogueState
    adapter_id: str | None
    down_since: float = 0.0  # unix seconds the store became unreachable (DOWN)


class StoreCatalogue:
    """name -> content id per the store's watch; ``on_change(name, content id or None)`` runs
    after each change is applied, before it is acknowledged."""

    def __init__(
        self,
        client: StoreClient,
        on_change: Callable[[str, str | None], None],
        *,
        backoff_s: float = 0.1,
        backoff_max_s: float = 5.0,
        stale_after_s: float = 3.0,
    ) -> None:
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.stale_after_s = stale_after_s
        self.apply_delay_s = 0.0  # test hook: a slow watcher (each change waits this long)
        self._client = client
        self._on_change = on_change
        self._label = f"worker {socket.gethostname()} pid {os.getpid()}"
        self._lock = threading.Lock()
        self._live = threading.Condition(self._lock)
        self._ids: dict[str, str] = {}
        self._state = CatalogueState.SYNCING
        self._heard = 0.0  # monotonic time of the last message
        self._down_since = 0.0
        self._closed = threading.Event()
        self._watch: AdapterWatch | None = None
        self._thread = threading.Thread(target=self._run, name="store-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        watch = self._watch
        if watch is not None:
            watch.cancel()
        self._thread.join(timeout=5)

    # -- queries ------------------------------------------------------------------------------
    def lookup(self, ref: str) -> Lookup:
        parsed = parse_ref(ref)
        with self._lock:
            state = self._state
            if state is CatalogueState.LIVE and time.monotonic() - self._heard > self.stale_after_s:
                state = CatalogueState.SYNCING  # silent: maybe a half-open connection
            adapter_id = self._ids.get(parsed.name)
            down_since = self._down_since
        if adapter_id is not None and not adapter_id.startswith(parsed.prefix):
            adapter_id = None
        return Lookup(state, adapter_id, down_since)

    @property
    def state(self) -> CatalogueState:
        return self.lookup("").state

    def wait_state(self, state: CatalogueState, timeout: float) -> bool:
        """Block until the catalogue is in ``state`` (tests, start-up); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._live:
            while self._state is not state:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._live.wait(remaining)
            return True

    # -- the watch thread -----------------------------------------------------------------------
    def _run(self) -> None:
        delay = self.backoff_s
        while not self._closed.is_set():
            try:
                self._watch = self._client.watch(self._label)
                snapshot: dict[str, str] = {}
                for message in self._watch:
                    if message.snapshot:
                        snapshot.update((c.name, c.adapter_id) for c in message.changes)
                        if message.snapshot_done:
                            self._replace(snapshot, message)
                            delay = self.backoff_s
                    else:
                        self._apply(message)
                reason = "the store ended the watch"
                self._set_state(CatalogueState.SYNCING)
            except SourceUnavailable as err:
                reason = str(err)
                self._set_state(CatalogueState.DOWN)
            except LorastreamError as err:
                reason = str(err)
                self._set_state(CatalogueState.SYNCING)
            if self._closed.is_set():
                return
            wait = delay * random.uniform(0.5, 1.0)
            log.warning("adapter store watch lost (%s); reconnecting in %.2fs", reason, wait)
            self._closed.wait(wait)
            delay = min(delay * 2, self.backoff_max_s)

    def _replace(self, snapshot: dict[str, str], message: WatchMessage) -> None:
        with self._lock:
            old, self._ids = self._ids, dict(snapshot)
            changed = [n for n in old.keys() | snapshot.keys() if old.get(n) != snapshot.get(n)]
        self._notify([(name, snapshot.get(name)) for name in changed])
        self._set_state(CatalogueState.LIVE)
        log.info("adapter catalogue synced: %d names at generation %d", len(snapshot),
                 message.generation)
        self._ack(message)

    def _apply(self, message: WatchMessage) -> None:
        if message.changes and self.apply_delay_s:
            time.sleep(self.apply_delay_s)
        with self._lock:
            self._heard = time.monotonic()
            for change in message.changes:
                if change.kind is ChangeKind.DELETE:
                    self._ids.pop(change.name, None)
                else:
                    self._ids[change.name] = change.adapter_id
        if message.changes:
            self._notify([(c.name, c.adapter_id or None) for c in message.changes])
            self._ack(message)

    def _notify(self, changes: list[tuple[str, str | None]]) -> None:
        for name, adapter_id in changes:
            try:
                self._on_change(name, adapter_id)
            except Exception:
                log.exception("catalogue change callback failed for %s", name)

    def _ack(self, message: WatchMessage) -> None:
        try:
            self._client.ack(message.watch_id, message.generation)
        except LorastreamError as err:
            log.warning("could not acknowledge change %d to the store: %s", message.generation,
                        err)

    def _set_state(self, state: CatalogueState) -> None:
        with self._live:
            if state is CatalogueState.DOWN and self._state is not CatalogueState.DOWN:
                self._down_since = time.time()
            self._state = state
            self._heard = time.monotonic()
            self._live.notify_all()
