"""A registration through PreloadAdapter does the same work at any number of names.

No timing: the work of one preload is counted at N=50 and N=500 names — SQLite virtual machine
steps on the registry's connection, Python lines run by the preload, directory entries listed,
and bytes sent on the reply stream and on an open watch — and must not grow with N (an O(N) cost
grows 10x between the two). Real store server on port 0, real tiny PEFT adapters, a
real watch that acknowledges; once with room in the disk budget, once with the budget full so
that every preload evicts the least recently used adapter.

Before the fix every staging grouped every name and version in SQLite to order eviction: that
showed here as SQLite steps growing with N.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from lorastream.bench.registry_rpc import DistinctAdapters, fill, name_of, served_store
from lorastream.core import codec
from lorastream.core.errors import LorastreamError
from lorastream.core.store_client import StoreClient
from lorastream.store.store import AdapterStore

SMALL, LARGE = 50, 500
GROWTH = 1.1  # allowed ratio LARGE / SMALL of any count (an O(N) cost gives ~10)


@dataclass
class Work:
    sqlite_steps: int = 0
    python_lines: int = 0
    entries_listed: int = 0
    reply_bytes: int = 0
    watch_bytes: int = 0


class _Listings:
    """Counts the entries of every directory listed (``os.scandir``/``os.listdir`` audit events)
    while ``current`` is set. Audit hooks cannot be removed: one is installed per process."""

    current: Work | None = None
    _installed = False
    _inside = threading.local()

    @classmethod
    def install(cls) -> None:
        if not cls._installed:
            sys.addaudithook(cls._hook)
            cls._installed = True

    @classmethod
    def _hook(cls, event: str, args: tuple[Any, ...]) -> None:
        work = cls.current
        if work is None or event not in ("os.scandir", "os.listdir"):
            return
        if getattr(cls._inside, "yes", False):
            return
        cls._inside.yes = True
        try:
            work.entries_listed += len(os.listdir(args[0] if args[0] is not None else "."))
        except OSError:
            pass
        finally:
            cls._inside.yes = False


class _WatchTap:
    """A watch that acknowledges every change and counts the bytes of the messages carrying
    them (as the store encodes them)."""

    def __init__(self, client: StoreClient) -> None:
        self.bytes = 0
        self.synced = threading.Event()
        self._client = client
        self._watch = client.watch("test-registration-flat")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for message in self._watch:
                if message.snapshot:
                    if message.snapshot_done:
                        self.synced.set()
                    continue
                if message.changes:
                    self.bytes += codec.watch_message_to_pb(message).ByteSize()
                    self._client.ack(message.watch_id, message.generation)
        except LorastreamError:
            pass  # cancelled at the end of the test

    def close(self) -> None:
        self._watch.cancel()
        self._thread.join(timeout=5)


def _python_lines(work: Work) -> Any:
    """A threading.settrace function counting the lines run on the store's preload threads."""

    def local(frame: FrameType, event: str, arg: object) -> Any:
        if event == "line":
            work.python_lines += 1
        return local

    def on_call(frame: FrameType, event: str, arg: object) -> Any:
        return local if threading.current_thread().name.startswith("preload-") else None

    return on_call


def _one_preload(client: StoreClient, store: AdapterStore, watch: _WatchTap,
                 adapters: DistinctAdapters, i: int, root: Path) -> Work:
    """The work of preloading distinct adapter ``i`` through the RPC."""
    source = adapters.write(i, root / "src" / f"a{i:07d}")  # written before counting
    work = Work()
    db = store._registry._db
    watched = watch.bytes

    def step() -> int:
        work.sqlite_steps += 1
        return 0

    db.set_progress_handler(step, 1)
    threading.settrace(_python_lines(work))
    _Listings.current = work
    try:
        events = list(client.preload(str(source), name_of(i)))
    finally:
        _Listings.current = None
        threading.settrace(None)
        db.set_progress_handler(None, 1)
    assert events[-1].manifest is not None and events[-1].manifest.name == name_of(i)
    work.reply_bytes = sum(codec.progress_to_pb(e).ByteSize() for e in events)
    work.watch_bytes = watch.bytes - watched
    return work


def _evictions(store: AdapterStore) -> float:
    return store.metrics.registry.get_sample_value("lorastream_store_evictions_total") or 0.0


def _work_at(names: int, root: Path, adapters: DistinctAdapters, full: bool) -> Work:
    """The work of one preload into a store holding ``names`` distinct adapters (the third of
    three, after two that warm it); ``full``: the budget holds exactly ``names`` of them."""
    with served_store(root, cache_bytes=1 << 40) as (client, store):
        fill(store, adapters, 0, names)
        if full:  # room for what is staged, and less than one more adapter
            store._contents.budget = store.bytes_used + store.bytes_used // names // 2
        with StoreClient(client.target) as watcher:
            watch = _WatchTap(watcher)
            try:
                assert watch.synced.wait(30)
                evictions = _evictions(store)
                for i in range(names, names + 2):
                    _one_preload(client, store, watch, adapters, i, root)
                work = _one_preload(client, store, watch, adapters, names + 2, root)
                evicted = _evictions(store) - evictions
            finally:
                watch.close()
        assert evicted == (3 if full else 0)
        assert store.count() == (names if full else names + 3)
    return work


@pytest.fixture(scope="module")
def adapters() -> DistinctAdapters:
    _Listings.install()
    return DistinctAdapters()


@pytest.mark.parametrize("full", [False, True], ids=["room", "full-budget"])
def test_a_preload_does_the_same_work_at_50_and_500_names(
    tmp_path: Path, adapters: DistinctAdapters, full: bool
) -> None:
    small = _work_at(SMALL, tmp_path / "small", adapters, full)
    large = _work_at(LARGE, tmp_path / "large", adapters, full)
    for field in ("sqlite_steps", "python_lines", "entries_listed"):
        few, many = getattr(small, field), getattr(large, field)
        assert few > 0, f"{field} was not counted"
        assert many <= few * GROWTH, f"{field}: {few} at {SMALL} names, {many} at {LARGE}"
    # The names have one width, so every message is the same size at any N, but for the watch's
    # generation numbers (varints: a byte more per 7 bits of N).
    assert small.reply_bytes == large.reply_bytes > 0
    assert 0 < small.watch_bytes <= large.watch_bytes <= small.watch_bytes + 4
