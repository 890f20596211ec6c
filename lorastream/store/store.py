"""The adapter store's core: names and their versions, watches, and shared downloads.

Plain Python, called by the gRPC servicer from a thread pool. The staged contents, their leases,
the disk budget and eviction are a :class:`StagedContents` it owns (``staged_contents.py``); the
downloads in flight a :class:`DownloadsInFlight` (``flights.py``). One RLock, created here and
shared with both, guards the name registry, the downloads in flight and the staged contents
together (the change feed, ``watch.py``, has its own); no download, validation or tensor read
happens while holding it.

Lifecycle of a preload of ``uri`` as ``name``::

    resolve (source) -> reserve estimated bytes (evict LRU if needed) -> download into cache/tmp
    -> validate + hash (staging.Stager.prepare) -> [lock] fit actual bytes, rename into
    cache/adapters/<id>, register the name (one registry transaction) [unlock] -> done

A push (:meth:`AdapterStore.push`) takes the same path from "reserve" on, its source being the
upload stream itself (``push://<name>``); pushes are never shared.

Two preloads of the same URI share one download (``flights.py``): the second waits for the
first's result and sees its progress events. A :class:`StreamLease` pins a content id's
files while a stream reads them: deleting or replacing a name drops the name at once, but the
files go only when the last lease closes, and eviction skips leased ids.

Versions (``versions.py``): a name's earlier content stays staged as its history until the disk
budget evicts it (as any unpinned content, never while leased); ``describe`` and ``open_stream``
take ``name@<content-id prefix>`` for one of them, and :meth:`AdapterStore.rollback` points the
name back at one.
"""

from __future__ import annotations

import builtins
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from lorastream.core.adapter_validation import DEFAULT_MAX_HEADER_BYTES
from lorastream.core.checksum import DEFAULT_TENSOR_DIGEST
from lorastream.core.errors import AdapterNotFound, AlreadyExists, Conflict
from lorastream.core.listing import AdapterFilter
from lorastream.core.manifest import AdapterManifest, PreloadProgress
from lorastream.core.upload import UploadChunk, UploadHeader, push_uri
from lorastream.core.versions import (
    AdapterChange,
    AdapterVersion,
    ChangeKind,
    VersionSelector,
    WatchMessage,
    parse_ref,
)
from lorastream.store.flights import DownloadsInFlight
from lorastream.store.metrics import StoreMetrics
from lorastream.store.names import validate_name
from lorastream.store.reader import StreamLease
from lorastream.store.registry import Registry, RegistryEntry
from lorastream.store.sources import SourceRegistry
from lorastream.store.sources.upload import UploadSource
from lorastream.store.staged_contents import StagedContents
from lorastream.store.staging import ProgressFn, StagedAdapter, Stager
from lorastream.store.versions import entry_for_ref, pick_rollback
from lorastream.store.watch import ChangeFeed

__all__ = ["AdapterStore", "StreamLease", "validate_name"]

DEFAULT_MAX_UPLOAD_BYTES = 4 << 30

log = logging.getLogger(__name__)


class AdapterStore:
    """Stages adapters from sources into ``cache_dir`` within ``cache_bytes`` and serves them."""

    def __init__(
        self,
        cache_dir: Path,
        cache_bytes: int,
        sources: SourceRegistry,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
        tensor_digest: str = DEFAULT_TENSOR_DIGEST,
        metrics: StoreMetrics | None = None,
    ) -> None:
        if cache_bytes <= 0:
            raise ValueError(f"cache_bytes must be positive, got {cache_bytes}")
        self._max_upload_bytes = max_upload_bytes
        self._sources = sources
        self._lock = threading.RLock()  # registry, flights and contents (module docstring)
        stager = Stager(Path(cache_dir), max_header_bytes, tensor_digest)
        stager.remove_stale_temp()
        self._registry = Registry(Path(cache_dir))
        self.changes = ChangeFeed()  # what watches see (watch.py)
        self.metrics = metrics or StoreMetrics()
        self._contents = StagedContents(
            stager, self._registry, cache_bytes, self._lock, self.metrics,
            on_evict=lambda name, adapter_id: self._publish(name, adapter_id, None),
        )
        self._contents.recover()
        self._flights = DownloadsInFlight(self._contents, self._lock)  # flights.py
        self.metrics.watch(self)

    # -- queries ----------------------------------------------------------------------------
    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._contents.bytes_used

    @property
    def bytes_budget(self) -> int:
        return self._contents.budget

    @property
    def staged_count(self) -> int:
        """Adapter contents on disk (names sharing files count once)."""
        with self._lock:
            return len(self._contents)

    def list(
        self, where: AdapterFilter = AdapterFilter(), after: str = "", limit: int | None = None
    ) -> list[AdapterManifest]:
        """Manifests of the names matching ``where``, in name order: those after ``after``, at
        most ``limit`` (pages: pass the last name of one page as ``after`` of the next)."""
        with self._lock:
            return [self._manifest_of(e) for e in self._registry.matching(where, after, limit)]

    def count(self, where: AdapterFilter = AdapterFilter()) -> int:
        """How many names match ``where``."""
        with self._lock:
            return self._registry.count(where)

    def describe(self, ref: str) -> AdapterManifest:
        """The manifest of ``name`` (its current version) or ``name@<content-id prefix>``."""
        with self._lock:
            return self._manifest_of(self._lookup(ref))

    def history(self, name: str) -> builtins.list[AdapterVersion]:
        """``name``'s versions, newest first (evicted ones too, marked not staged)."""
        validate_name(name)
        with self._lock:
            versions = self._registry.versions(name)
        if not versions:
            raise AdapterNotFound(f"no adapter named {name!r} and no history of one")
        return versions

    def rollback(self, name: str, selector: VersionSelector = VersionSelector()
                 ) -> AdapterManifest:
        """Point ``name`` at an earlier staged version again (appended as its newest); with no
        selector, at the content it pointed at before its current one."""
        validate_name(name)
        with self._lock:
            target = pick_rollback(name, selector, self._registry.versions(name))
            old = self._registry.get(name)
            entry = self._registry.rollback(name, target, time.time())
            self._publish(name, old.adapter_id if old else None, entry.adapter_id)
            manifest = self._manifest_of(entry)
        log.info("rolled %s back to %s (version %d)", name, target.adapter_id[:12],
                 target.version)
        self._settle()
        return manifest

    # -- watches (watch.py) -----------------------------------------------------------------
    def watch(self, label: str, is_active: Callable[[], bool]) -> Iterator[WatchMessage]:
        """A snapshot of every name's current content, then each change as it is made."""
        with self._lock:
            names = [AdapterChange(ChangeKind.PUT, name, adapter_id, version)
                     for name, adapter_id, version in self._registry.current_versions()]
            return self.changes.watch(label, names, is_active)

    def ack(self, watch_id: str, generation: int) -> None:
        self.changes.ack(watch_id, generation)

    def _publish(self, name: str, old_id: str | None, new_id: str | None) -> None:
        """Tell the watches that ``name`` moved from ``old_id`` to ``new_id`` (lock held)."""
        if old_id == new_id:
            return
        if new_id is None:
            change = AdapterChange(ChangeKind.DELETE, name)
        else:
            kind = ChangeKind.PUT if old_id is None else ChangeKind.VERSION
            change = AdapterChange(kind, name, new_id, self._registry.latest_version(name))
        self.changes.publish([change])

    def _settle(self) -> None:
        """Wait (unlocked) until the watches acknowledged every change published so far."""
        self.changes.wait_acked(self.changes.generation)

    # -- operator calls ---------------------------------------------------------------------
    def delete(self, name: str) -> None:
        """Forget ``name`` now; its files go when no other name and no stream uses them."""
        with self._lock:
            entry = self._entry(name)
            history = self._registry.versions(name)
            self._registry.delete([name])
            self._publish(name, entry.adapter_id, None)
            for adapter_id in {entry.adapter_id, *(v.adapter_id for v in history)}:
                self._contents.collect(adapter_id)
        log.info("deleted adapter %s and its history", name)
        self._settle()

    def pin(self, name: str) -> AdapterManifest:
        return self._set_pinned(name, True)

    def unpin(self, name: str) -> AdapterManifest:
        return self._set_pinned(name, False)

    def _set_pinned(self, name: str, pinned: bool) -> AdapterManifest:
        with self._lock:
            entry = self._entry(name)
            if entry.pinned != pinned:
                self._registry.set_pinned(name, pinned)
                entry.pinned = pinned
            return self._manifest_of(entry)

    def preload(
        self,
        uri: str,
        name: str,
        *,
        pin: bool = False,
        force: bool = False,
        progress: ProgressFn | None = None,
    ) -> AdapterManifest:
        """Stage ``uri`` as ``name``; returns the manifest (also sent as the "done" event).

        The same name and URI again returns the staged adapter unless ``force``; a name already
        bound to another URI needs ``force`` (AlreadyExists otherwise).
        """
        validate_name(name)
        emit: ProgressFn = progress or (lambda _event: None)
        source = self._sources.for_uri(uri)
        with self._lock:
            existing = self._registry.get(name)
            if existing is not None and not force:
                if existing.source_uri != uri:
                    raise AlreadyExists(
                        f"adapter {name} is already staged from {existing.source_uri}; delete it "
                        "first or preload with force to replace it"
                    )
                staged_before = self._set_pinned(name, True) if pin else self._manifest_of(existing)
            else:
                staged_before = None
                flight, owner = self._flights.join_or_start(uri, name)
        self.metrics.preload_requested(cached=staged_before is not None)
        if staged_before is not None:
            total = staged_before.total_bytes
            emit(PreloadProgress("done", total, total, "already staged", staged_before))
            return staged_before
        flight.subscribe(emit)
        try:
            if owner:
                self._flights.fly(flight, source)
            flight.finished.wait()
        finally:
            flight.unsubscribe(emit)
        if flight.error is not None:
            raise flight.error
        assert flight.result is not None
        staged, revision = flight.result
        with self._lock:
            try:
                manifest = self._register(name, uri, revision, staged, pin=pin, force=force)
            finally:
                self._contents.release(staged.adapter_id)
        log.info("staged %s from %s as %s", name, uri, staged.adapter_id[:12])
        self._settle()
        emit(PreloadProgress("done", manifest.total_bytes, manifest.total_bytes, "", manifest))
        return manifest

    def push(self, header: UploadHeader, chunks: Iterator[UploadChunk]) -> AdapterManifest:
        """Stage the adapter an upload stream carries as ``header.name``, from ``push://<name>``.

        Validated, hashed and committed exactly like a preload (same content: same id, one copy).
        A name staged from another source needs ``header.force`` (AlreadyExists otherwise); one
        pushed before is replaced. A failed upload (bad files, cut stream, too large) leaves
        nothing staged and the name as it was.
        """
        name = header.name
        validate_name(name)
        uri = push_uri(name)
        with self._lock:
            existing = self._registry.get(name)
            if existing is not None and not header.force and existing.source_uri != uri:
                raise AlreadyExists(
                    f"adapter {name} is already staged from {existing.source_uri}; delete it "
                    "first or push with force to replace it"
                )
        source = UploadSource(header, chunks, self._max_upload_bytes)
        try:
            staged = self._contents.stage(source, source.resolve(uri), lambda *_: None, lambda: 1)
        except BaseException as err:
            log.warning("push of %s failed: %s", name, err)
            raise
        with self._lock:
            try:
                manifest = self._register(name, uri, "", staged, pin=header.pin, force=header.force)
            finally:
                self._contents.release(staged.adapter_id)
        log.info("staged pushed adapter %s as %s", name, staged.adapter_id[:12])
        self._settle()
        return manifest

    # -- streaming --------------------------------------------------------------------------
    def open_stream(self, name: str, adapter_id: str | None = None) -> StreamLease:
        """Lease the files of ``name`` (or ``name@<content-id prefix>``: that version) for a
        stream; ``adapter_id`` asserts which content is expected.

        Raises Conflict when ``name`` now maps to other content than ``adapter_id`` (it was
        replaced since the stream started); restart the stream without an id.
        """
        with self._lock:
            entry = self._lookup(name)
            if adapter_id and adapter_id != entry.adapter_id:
                raise Conflict(
                    f"adapter {name} now has content {entry.adapter_id}, not {adapter_id}: it was "
                    "replaced since this stream began; restart the stream from the beginning"
                )
            staged = self._contents.lease(entry.adapter_id)
            entry.last_used_at = time.time()
            try:
                if parse_ref(name).pinned:
                    self._registry.touch_version(entry.name, entry.adapter_id, entry.last_used_at)
                else:
                    self._registry.touch(name, entry.last_used_at)
            except Exception:
                log.warning("could not record the last use of %s", name, exc_info=True)
            manifest = self._manifest_of(entry)
        return StreamLease(
            manifest, staged, lambda: self._contents.release_locked(staged.adapter_id)
        )

    # -- internals (callers hold self._lock unless noted) -----------------------------------
    def _entry(self, name: str) -> RegistryEntry:
        validate_name(name)
        entry = self._registry.get(name)
        if entry is None:
            raise AdapterNotFound(f"no adapter named {name!r}; preload it first (adapters ls)")
        return entry

    def _lookup(self, ref: str) -> RegistryEntry:
        """The entry ``ref`` names: a name's current one, or one version of its history."""
        return self._entry(ref) if not parse_ref(ref).pinned else entry_for_ref(self._registry, ref)

    def _manifest_of(self, entry: RegistryEntry) -> AdapterManifest:
        return self._contents[entry.adapter_id].manifest(
            name=entry.name,
            source_uri=entry.source_uri,
            revision=entry.revision,
            created_at=entry.created_at,
            pinned=entry.pinned,
            last_used_at=entry.last_used_at,
        )

    def _register(
        self, name: str, uri: str, revision: str, staged: StagedAdapter, *, pin: bool, force: bool
    ) -> AdapterManifest:
        old = self._registry.get(name)
        if old is not None and not force and old.source_uri != uri:
            raise AlreadyExists(
                f"adapter {name} was staged from {old.source_uri} meanwhile; retry with force to "
                "replace it"
            )
        now = time.time()
        entry = RegistryEntry(
            name=name,
            adapter_id=staged.adapter_id,
            source_uri=uri,
            revision=revision,
            created_at=now,
            last_used_at=now,
            pinned=pin or (old.pinned if old is not None else False),
        )
        self._registry.put(entry)
        self._publish(name, old.adapter_id if old else None, entry.adapter_id)
        if old is not None and old.adapter_id != staged.adapter_id:
            self._contents.collect(old.adapter_id)
        return self._manifest_of(entry)
