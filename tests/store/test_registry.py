"""The SQLite name registry: crash safety, migration from registry.json, filtered pages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lorastream.core.errors import InvalidArgument
from lorastream.core.listing import AdapterFilter
from lorastream.core.store_client import StoreClient
from lorastream.store.config import StoreSettings
from lorastream.store.registry import (
    LEGACY_FILE,
    REGISTRY_FILE,
    Registry,
    RegistryEntry,
)
from lorastream.store.server import create_server
from tests.store.fixtures_core import StoreFactory

REPO = Path(__file__).resolve().parents[2]


def _entry(name: str, adapter_id: str = "a" * 64, **fields: object) -> RegistryEntry:
    values: dict[str, object] = {
        "source_uri": f"s3://bucket/{name}", "revision": "etag", "created_at": 1.0,
        "last_used_at": 1.0, "pinned": False, **fields,
    }
    return RegistryEntry(name=name, adapter_id=adapter_id, **values)  # type: ignore[arg-type]  # values: the entry's own fields


# Registers names one at a time, printing each name once its registration returned.
_REGISTER_FOREVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from lorastream.store.registry import Registry, RegistryEntry

    registry = Registry(Path(sys.argv[1]))
    i = 0
    while True:
        name = f"org/adapter-{i:06d}"
        entry = RegistryEntry(name, f"{i:064x}", f"s3://b/{name}", "rev", 1.0, 2.0, i % 2 == 0)
        registry.put(entry)
        print(name, flush=True)
        i += 1
    """
)


@pytest.mark.parametrize("acks_before_kill", [1, 40, 300])
def test_a_sigkill_during_registration_loses_nothing_acknowledged_and_leaves_nothing_half(
    tmp_path: Path, acks_before_kill: int
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _REGISTER_FOREVER, str(tmp_path)],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )
    assert proc.stdout is not None
    acknowledged = [proc.stdout.readline().strip() for _ in range(acks_before_kill)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    survivors = Registry(tmp_path).matching()
    names = [e.name for e in survivors]
    assert set(acknowledged) <= set(names)
    assert names == [f"org/adapter-{i:06d}" for i in range(len(names))]  # no gap, no stranger
    for i, e in enumerate(survivors):  # each row whole, as written
        assert (e.adapter_id, e.source_uri, e.revision, e.pinned) == (
            f"{i:064x}", f"s3://b/{e.name}", "rev", i % 2 == 0)


def test_changes_persist_across_reopening(tmp_path: Path) -> None:
    registry = Registry(tmp_path)
    registry.put(_entry("a"))
    registry.put(_entry("b", "b" * 64))
    registry.set_pinned("a", True)
    registry.touch("b", 5.0)
    registry.put(_entry("b", "c" * 64))  # replaced: points at new content
    registry.delete(["missing", "a"])
    registry.close()
    again = Registry(tmp_path)
    assert [(e.name, e.adapter_id, e.last_used_at) for e in again.matching()] == [
        ("b", "c" * 64, 1.0)]
    assert again.names_of("c" * 64) == ["b"] and not again.is_referenced("a" * 64)


def test_names_are_listed_in_pages_with_filters(tmp_path: Path) -> None:
    registry = Registry(tmp_path)
    for i in range(25):
        source = "hf://org/x" if i % 3 == 0 else f"s3://bucket/{i}"
        registry.put(_entry(f"team{i % 2}/a{i:02d}", pinned=i % 5 == 0, source_uri=source))
    registry.put(_entry("team_/odd%name"))  # LIKE's wildcards are plain characters in a prefix
    pages, after = [], ""
    while page := registry.matching(after=after, limit=7):
        pages.append(page)
        after = page[-1].name
    assert [len(p) for p in pages] == [7, 7, 7, 5]
    everything = [e.name for p in pages for e in p]
    assert everything == sorted(everything) and len(set(everything)) == 26
    assert {e.name for e in registry.matching(AdapterFilter(prefix="team1/"))} == {
        f"team1/a{i:02d}" for i in range(1, 25, 2)}
    assert [e.name for e in registry.matching(AdapterFilter(prefix="team_"))] == ["team_/odd%name"]
    assert {e.name for e in registry.matching(AdapterFilter(pinned=True))} == {
        f"team{i % 2}/a{i:02d}" for i in range(0, 25, 5)}
    hub = registry.matching(AdapterFilter(source_prefix="hf://", pinned=False))
    assert {e.name for e in hub} == {f"team{i % 2}/a{i:02d}" for i in range(3, 25, 3)
                                      if i % 5 != 0}


def test_a_legacy_registry_json_is_imported_once(tmp_path: Path) -> None:
    names = [{"name": "old/a", "adapter_id": "a" * 64, "source_uri": "s3://b/a",
              "revision": "r1", "created_at": 3.0, "last_used_at": 4.0, "pinned": True},
             {"name": "old/b", "adapter_id": "b" * 64, "source_uri": "/data/b",
              "revision": "r2", "created_at": 5.0, "last_used_at": 6.0, "pinned": False}]
    (tmp_path / LEGACY_FILE).write_text(json.dumps({"format": 1, "names": names}))
    registry = Registry(tmp_path)
    assert [vars(e) for e in registry.matching()] == names
    assert not (tmp_path / LEGACY_FILE).exists()
    assert (tmp_path / f"{LEGACY_FILE}.migrated").exists()
    registry.delete(["old/a"])
    registry.close()
    assert [e.name for e in Registry(tmp_path).matching()] == ["old/b"]  # not imported again


@pytest.mark.parametrize(
    ("file", "content"),
    [(LEGACY_FILE, "{not json"), (LEGACY_FILE, '{"format": 9, "names": []}'),
     (REGISTRY_FILE, "this is not a database, but it is long enough to look like one" * 20)],
)
def test_an_unreadable_registry_is_refused_with_what_to_do(
    tmp_path: Path, file: str, content: str
) -> None:
    (tmp_path / file).write_text(content)
    with pytest.raises(InvalidArgument, match="move it away"):
        Registry(tmp_path)


def test_the_store_lists_pages_and_filters(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory
) -> None:
    store = store_factory()
    for name in ("b/one", "a/two", "b/three"):
        store.preload(str(tiny_adapters["attn-r4"]), name, pin=name == "b/three")
    assert [m.name for m in store.list(limit=2)] == ["a/two", "b/one"]
    assert [m.name for m in store.list(after="b/one")] == ["b/three"]
    assert [m.name for m in store.list(AdapterFilter(prefix="b/", pinned=False))] == ["b/one"]


def test_list_adapters_over_grpc_pages_and_filters(
    tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    server, port, _ = create_server(StoreSettings(port=0, cache_dir=tmp_path / "cache"))
    server.start()
    try:
        with StoreClient(f"127.0.0.1:{port}") as client:
            for name in ("b/one", "a/two", "b/three", "b/four", "c/five"):
                for _ in client.preload(str(tiny_adapters["attn-r4"]), name, pin=name == "b/four"):
                    pass
            pages = [[m.name for m in page] for page, _, _ in client.pages(page_size=2)]
            assert pages == [["a/two", "b/four"], ["b/one", "b/three"], ["c/five"]]
            everything, used, budget = client.list()
            assert [m.name for m in everything] == [name for page in pages for name in page]
            assert 0 < used <= budget
            unpinned_b, _, _ = client.list(AdapterFilter(prefix="b/", pinned=False))
            assert [m.name for m in unpinned_b] == ["b/one", "b/three"]
            assert client.list(AdapterFilter(source_prefix="s3://"))[0] == []
            with pytest.raises(InvalidArgument, match="page_size"):
                list(client.pages(page_size=-1))
    finally:
        server.stop(None).wait()
