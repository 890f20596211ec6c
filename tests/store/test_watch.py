"""Issue 25 item 4, the store's side: WatchAdapters streams a snapshot, then every change; a
registration returns only once every open watch acknowledged it (or was dropped for not doing so
in time). A real store server on port 0, real PEFT adapters."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorastream.core import errors
from lorastream.core.store_client import AdapterWatch, StoreClient
from lorastream.core.versions import AdapterChange, ChangeKind, WatchMessage
from lorastream.store import watch as watch_module
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server
from lorastream.store.store import AdapterStore
from tests.store.fixtures_core import copy_adapter


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, AdapterStore]]:
    server, port, store = create_server(StoreSettings(port=0, cache_dir=tmp_path / "cache"))
    server.start()
    yield f"127.0.0.1:{port}", store
    server.stop(None).wait()


@pytest.fixture
def contents(tiny_adapters: dict[str, Path], tmp_path: Path) -> list[str]:
    return [str(copy_adapter(tiny_adapters["attn-r4"], tmp_path / f"c{i}", lora_alpha=4 + i))
            for i in range(3)]


def _preload(client: StoreClient, uri: str, name: str) -> str:
    manifest = list(client.preload(uri, name, force=True))[-1].manifest
    assert manifest is not None
    return manifest.adapter_id


def _changes(messages: Iterator[WatchMessage], count: int) -> list[WatchMessage]:
    """The next ``count`` messages that carry changes (heartbeats skipped)."""
    got: list[WatchMessage] = []
    while len(got) < count:
        message = next(messages)
        if message.changes:
            got.append(message)
    return got


def test_a_watch_gets_a_snapshot_then_every_change_in_order(
    served: tuple[str, AdapterStore], contents: list[str]
) -> None:
    target, _ = served
    with StoreClient(target) as client, StoreClient(target) as operator:
        first = _preload(operator, contents[0], "a")
        watch = client.watch("test")
        messages = iter(watch)
        snapshot = next(messages)
        assert snapshot.snapshot and snapshot.snapshot_done
        assert snapshot.changes == (AdapterChange(ChangeKind.PUT, "a", first, 1),)
        client.ack(snapshot.watch_id, snapshot.generation)
        done: list[str] = []

        def operate() -> None:
            done.append(_preload(operator, contents[1], "b"))
            done.append(_preload(operator, contents[2], "a"))
            operator.rollback("a")
            operator.delete("b")

        worker = threading.Thread(target=operate)
        worker.start()
        seen: list[AdapterChange] = []
        for _ in range(4):
            message = _changes(messages, 1)[0]
            seen += message.changes
            client.ack(message.watch_id, message.generation)  # lets the operation return
        worker.join(10)
        watch.cancel()
    assert seen == [
        AdapterChange(ChangeKind.PUT, "b", done[0], 1),
        AdapterChange(ChangeKind.VERSION, "a", done[1], 2),
        AdapterChange(ChangeKind.VERSION, "a", first, 3),
        AdapterChange(ChangeKind.DELETE, "b"),
    ]


def test_a_push_returns_only_after_the_watch_acknowledged_it(
    served: tuple[str, AdapterStore], contents: list[str]
) -> None:
    target, store = served
    store.changes.ack_timeout_s = 5.0
    with StoreClient(target) as client, StoreClient(target) as operator:
        messages = iter(client.watch("slow worker"))
        snapshot = next(messages)
        returned = threading.Event()
        thread = threading.Thread(
            target=lambda: (_preload(operator, contents[0], "a"), returned.set()))
        thread.start()
        change = _changes(messages, 1)[0]
        time.sleep(0.3)
        assert not returned.is_set(), "the preload returned before the watch applied it"
        client.ack(snapshot.watch_id, change.generation)
        assert returned.wait(5)
        thread.join()


def test_a_watch_that_does_not_acknowledge_is_dropped_and_the_push_returns(
    served: tuple[str, AdapterStore], contents: list[str]
) -> None:
    target, store = served
    store.changes.ack_timeout_s = 0.3
    with StoreClient(target) as client, StoreClient(target) as operator:
        watch = client.watch("stuck worker")
        messages = iter(watch)
        snapshot = next(messages)
        started = time.monotonic()
        _preload(operator, contents[0], "a")
        assert 0.3 <= time.monotonic() - started < 3
        with pytest.raises(StopIteration):  # the store ended the dropped watch
            _changes(messages, 2)
        with pytest.raises(errors.InvalidArgument, match="open a new WatchAdapters"):
            client.ack(snapshot.watch_id, 1)


def test_the_snapshot_comes_in_pages(
    served: tuple[str, AdapterStore], contents: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, _ = served
    monkeypatch.setattr(watch_module, "SNAPSHOT_PAGE", 2)
    with StoreClient(target) as client:
        for i in range(5):
            _preload(client, contents[0], f"n{i}")
        watch: AdapterWatch = client.watch("pager")
        messages = iter(watch)
        pages = [next(messages) for _ in range(3)]
        watch.cancel()
    assert [len(p.changes) for p in pages] == [2, 2, 1]
    assert [p.snapshot_done for p in pages] == [False, False, True]
    assert [c.name for p in pages for c in p.changes] == [f"n{i}" for i in range(5)]
