"""The worker's copy of the store's catalogue (name -> current content id), kept by a watch.

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
"""

from __future__ import annotations

import enum
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from lorastream.core.errors import LorastreamError, SourceUnavailable
from lorastream.core.store_client import AdapterWatch, StoreClient
from lorastream.core.versions import ChangeKind, WatchMessage, parse_ref

log = logging.getLogger(__name__)


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
            except Exception:  # noqa: BLE001 - one bad callback must not stop the watch
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
