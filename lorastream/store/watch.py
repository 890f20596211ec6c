"""The store's change feed: what ``WatchAdapters`` streams and ``AckAdapterChanges`` confirms.

Every change of what a name points at (registration, new version, rollback, delete, eviction)
gets the next *generation* and goes to every open watch, in the order the registry committed them
(the store publishes under its own lock). A watch starts with a snapshot of every name at the
generation it joined, then streams the changes after it, and a heartbeat when idle.

The ordering guarantee: a preload, push, rollback or delete returns to its caller only after every
watch open when it was published has acknowledged its generation (the watcher applied it), or
was dropped for not doing so within ``ack_timeout_s`` (its stream ends; the watcher resolves
through the store until it is back). So once a push is acknowledged, no connected worker resolves
the name to the old content. Example: watches A (acked 7) and B (acked 7); a push publishes 8 and
waits; A acks 8 at once, B is stuck: after ``ack_timeout_s`` B is dropped and the push returns.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from lorastream.core.errors import InvalidArgument
from lorastream.core.versions import AdapterChange, WatchMessage

log = logging.getLogger(__name__)

SNAPSHOT_PAGE = 1000  # names per snapshot message
DEFAULT_ACK_TIMEOUT_S = 2.0
DEFAULT_HEARTBEAT_S = 0.5


@dataclass
class _Watcher:
    watch_id: str
    label: str
    joined: int  # generation of its snapshot
    acked: int
    pending: list[tuple[int, tuple[AdapterChange, ...]]] = field(default_factory=list)
    dropped: bool = False
    closed: bool = False


class ChangeFeed:
    """Generations, open watches and their acknowledgements (thread-safe)."""

    def __init__(self, ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        self.ack_timeout_s = ack_timeout_s
        self.heartbeat_s = heartbeat_s
        self._cond = threading.Condition()
        self._generation = 0
        self._watchers: dict[str, _Watcher] = {}
        self._ids = itertools.count(1)

    @property
    def generation(self) -> int:
        with self._cond:
            return self._generation

    def publish(self, changes: Sequence[AdapterChange]) -> int:
        """Give ``changes`` the next generation and queue them for every watch (call under the
        store's lock, so generations follow the registry's commit order); returns it."""
        with self._cond:
            if not changes:
                return self._generation
            self._generation += 1
            for watcher in self._watchers.values():
                watcher.pending.append((self._generation, tuple(changes)))
            self._cond.notify_all()
            return self._generation

    def wait_acked(self, generation: int) -> None:
        """Return once every watch that should see ``generation`` acknowledged it; drop those
        that do not within ``ack_timeout_s`` (call without the store's lock)."""
        deadline = time.monotonic() + self.ack_timeout_s
        with self._cond:
            while True:
                laggards = [w for w in self._watchers.values()
                            if w.joined < generation and w.acked < generation]
                if not laggards:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    for watcher in laggards:
                        log.warning(
                            "dropping watch %s (%s): it did not acknowledge change %d within "
                            "%.1fs (acknowledged %d)", watcher.watch_id, watcher.label,
                            generation, self.ack_timeout_s, watcher.acked,
                        )
                        watcher.dropped = True
                        del self._watchers[watcher.watch_id]
                    self._cond.notify_all()
                    return
                self._cond.wait(remaining)

    def ack(self, watch_id: str, generation: int) -> None:
        with self._cond:
            watcher = self._watchers.get(watch_id)
            if watcher is None:
                raise InvalidArgument(
                    f"no open watch {watch_id!r} (it ended or was dropped for acknowledging too "
                    "late); open a new WatchAdapters stream"
                )
            if generation > watcher.acked:
                watcher.acked = min(generation, self._generation)
                self._cond.notify_all()

    def watch(self, label: str, names: list[AdapterChange],
              is_active: Callable[[], bool]) -> Iterator[WatchMessage]:
        """A new watch whose snapshot is ``names`` (every name's current content). Call under the
        store's lock, as :meth:`publish` is: no change falls between the snapshot and the watch."""
        with self._cond:
            watch_id = f"w{next(self._ids)}"
            watcher = _Watcher(watch_id, label, self._generation, self._generation)
            self._watchers[watch_id] = watcher
        log.info("watch %s opened by %s at generation %d (%d names)", watch_id, label,
                 watcher.joined, len(names))
        return self._stream(watcher, names, is_active)

    def _stream(self, watcher: _Watcher, names: list[AdapterChange],
                is_active: Callable[[], bool]) -> Iterator[WatchMessage]:
        try:
            pages = [names[i:i + SNAPSHOT_PAGE] for i in range(0, len(names), SNAPSHOT_PAGE)]
            for i, page in enumerate(pages or [[]]):
                yield WatchMessage(watcher.watch_id, watcher.joined, tuple(page), snapshot=True,
                                   snapshot_done=i == len(pages or [[]]) - 1)
            while True:
                with self._cond:
                    if not watcher.pending and not watcher.dropped:
                        self._cond.wait(self.heartbeat_s)
                    if watcher.dropped:
                        return
                    batch, watcher.pending = watcher.pending, []
                    generation = self._generation
                if not is_active():
                    return
                if not batch:
                    yield WatchMessage(watcher.watch_id, generation)  # heartbeat
                for generation, changes in batch:
                    yield WatchMessage(watcher.watch_id, generation, changes)
        finally:
            with self._cond:
                watcher.closed = True
                self._watchers.pop(watcher.watch_id, None)
                self._cond.notify_all()
            log.info("watch %s (%s) ended", watcher.watch_id, watcher.label)
