"""Issue 25 item 3: a name points at a content id and keeps its history.

Every registration that changes a name's content appends a version; ``name@<id prefix>`` names
one; ``rollback`` points the name back; old versions are evicted by the disk budget like any
unpinned content, never while streamed. Real PEFT adapters, real SQLite files, real gRPC servers.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lorastream.cli.main import app
from lorastream.core import errors
from lorastream.core.store_client import StoreClient
from lorastream.core.versions import VersionSelector, parse_ref
from lorastream.store.config import StoreSettings
from lorastream.store.registry import REGISTRY_FILE, Registry, RegistryEntry
from lorastream.store.server import create_server
from lorastream.store.versions import entry_for_ref
from tests.store.fixtures_core import (
    StoreFactory,
    assert_cache_clean,
    assert_streams_intact,
    copy_adapter,
)

REPO = Path(__file__).resolve().parents[2]
OPERATE, READ = "versions-operate", "versions-read"


@pytest.fixture
def variants(tiny_adapters: dict[str, Path], tmp_path: Path) -> list[Path]:
    """Three contents of one adapter (the alpha differs, so the content id does)."""
    return [copy_adapter(tiny_adapters["attn-r4"], tmp_path / f"v{i}", lora_alpha=8 + i)
            for i in range(3)]


def _entry(name: str, adapter_id: str) -> RegistryEntry:
    return RegistryEntry(name, adapter_id, f"s3://b/{name}/{adapter_id[:4]}", "", 1.0, 1.0)


# -- the history ----------------------------------------------------------------------------
def test_each_new_content_is_a_version_and_the_same_content_again_is_not(
    store_factory: StoreFactory, variants: list[Path], tmp_path: Path
) -> None:
    store = store_factory()
    ids = [store.preload(str(v), "x", force=True).adapter_id for v in variants]
    store.preload(str(variants[2]), "x", force=True)  # same content: no new version
    history = store.history("x")
    assert [(v.version, v.adapter_id, v.current, v.staged) for v in history] == [
        (3, ids[2], True, True), (2, ids[1], False, True), (1, ids[0], False, True)]
    assert history[1].source_uri == str(variants[1]) and history[1].total_bytes > 0
    assert_cache_clean(store, tmp_path / "cache")
    reopened = store_factory()  # the history is in the registry file
    assert [v.adapter_id for v in reopened.history("x")] == ids[::-1]


def test_a_pinned_reference_describes_and_streams_that_version(
    store_factory: StoreFactory, variants: list[Path]
) -> None:
    store = store_factory()
    old, new = (store.preload(str(v), "x", force=True) for v in variants[:2])
    assert store.describe("x").adapter_id == new.adapter_id
    for ref in (f"x@{old.adapter_id[:8]}", f"x@{old.adapter_id}"):
        assert store.describe(ref).adapter_id == old.adapter_id
        streamed = assert_streams_intact(store, ref)
        assert (streamed.adapter_id, streamed.name, streamed.alpha) == (old.adapter_id, "x", 8)


@pytest.mark.parametrize("case", ["unknown", "ambiguous", "not-hex", "evicted", "no-name"])
def test_a_bad_pinned_reference_says_what_is_wrong(tmp_path: Path, case: str) -> None:
    registry = Registry(tmp_path)
    ids = ["ab12" + "0" * 60, "ab34" + "0" * 60, "cd56" + "0" * 60]
    for adapter_id in ids:
        registry.put(_entry("x", adapter_id))
    for adapter_id in (ids[0], ids[2]):  # ids[1] was evicted
        registry.set_size(adapter_id, 10)
    assert entry_for_ref(registry, "x@ab1").adapter_id == ids[0]
    ref, error, message = {
        "unknown": ("x@ef", errors.AdapterNotFound, "no version of 'x' .* history x"),
        "ambiguous": ("x@ab", errors.InvalidArgument, "ambiguous: 2 versions"),
        "not-hex": ("x@AB", errors.InvalidArgument, "lowercase hex"),
        "evicted": ("x@ab3", errors.AdapterNotFound, "v2 of x .* was evicted"),
        "no-name": ("y@ab", errors.AdapterNotFound, "no version of 'y'"),
    }[case]
    with pytest.raises(error, match=message):
        entry_for_ref(registry, ref)


@pytest.mark.parametrize("selector, expect", [
    (VersionSelector(), 1), (VersionSelector(number=1), 0), (VersionSelector(prefix="?"), 0),
])
def test_rollback_points_the_name_back_and_records_it_as_its_newest_version(
    store_factory: StoreFactory, variants: list[Path], selector: VersionSelector, expect: int
) -> None:
    store = store_factory()
    ids = [store.preload(str(v), "x", force=True).adapter_id for v in variants]
    store.pin("x")
    if selector.prefix:
        selector = VersionSelector(prefix=ids[0][:10])
    manifest = store.rollback("x", selector)
    assert manifest.adapter_id == ids[expect] and manifest.pinned  # the pin stays with the name
    assert store.describe("x").adapter_id == ids[expect]
    assert [(v.version, v.adapter_id, v.current) for v in store.history("x")[:2]] == [
        (4, ids[expect], True), (3, ids[2], False)]


def test_rollback_refuses_what_it_cannot_do(
    store_factory: StoreFactory, variants: list[Path]
) -> None:
    store = store_factory()
    store.preload(str(variants[0]), "x")
    with pytest.raises(errors.InvalidArgument, match=r"no earlier content"):
        store.rollback("x")
    with pytest.raises(errors.AdapterNotFound, match=r"no version v7 .* v1 to v1"):
        store.rollback("x", VersionSelector(number=7))
    with pytest.raises(errors.AdapterNotFound, match=r"no adapter named 'y'"):
        store.rollback("y")


def test_delete_forgets_the_name_with_its_history_and_files(
    store_factory: StoreFactory, variants: list[Path], tmp_path: Path
) -> None:
    store = store_factory()
    for v in variants:
        store.preload(str(v), "x", force=True)
    store.delete("x")
    with pytest.raises(errors.AdapterNotFound):
        store.history("x")
    assert os.listdir(tmp_path / "cache" / "adapters") == []


# -- the disk budget --------------------------------------------------------------------------
def test_old_versions_are_evicted_by_the_budget_but_never_while_streamed(
    store_factory: StoreFactory, variants: list[Path], tmp_path: Path
) -> None:
    probe = store_factory(cache_dir=tmp_path / "probe")
    probe.preload(str(variants[0]), "p")
    size = probe.bytes_used  # on disk: what the budget counts
    store = store_factory(cache_bytes=3 * size + size // 2)
    old = store.preload(str(variants[0]), "x")
    store.preload(str(variants[1]), "x", force=True)
    store.pin("x")  # protects x's current content only
    lease = store.open_stream(f"x@{old.adapter_id[:8]}")  # a worker streams the old version
    store.preload(str(variants[2]), "y", pin=True)  # fits beside them: 3 of 3.5
    newcomer = copy_adapter(variants[2], tmp_path / "w", lora_alpha=99)
    with pytest.raises(errors.CapacityExhausted, match=r"cannot fit"):
        store.preload(str(newcomer), "w")
    assert [v.staged for v in store.history("x")] == [True, True]
    lease.close()
    store.preload(str(newcomer), "w")  # now the old version is what goes
    assert [(v.version, v.staged, v.total_bytes > 0) for v in store.history("x")] == [
        (2, True, True), (1, False, False)]
    with pytest.raises(errors.AdapterNotFound, match=r"evicted"):
        store.describe(f"x@{old.adapter_id[:8]}")
    assert_cache_clean(store, tmp_path / "cache")


# -- the registry file --------------------------------------------------------------------------
_SCHEMA_1 = """CREATE TABLE names (name TEXT PRIMARY KEY, adapter_id TEXT NOT NULL,
    source_uri TEXT NOT NULL, revision TEXT NOT NULL, created_at REAL NOT NULL,
    last_used_at REAL NOT NULL, pinned INTEGER NOT NULL CHECK (pinned IN (0, 1))) WITHOUT ROWID"""


def test_a_schema_1_registry_gains_its_history_once(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / REGISTRY_FILE) as db:
        db.execute(_SCHEMA_1)
        db.executemany("INSERT INTO names VALUES (?, ?, 's3://b', 'r', 5.0, 6.0, ?)",
                       [("a", "1" * 64, 1), ("b", "2" * 64, 0)])
        db.execute("PRAGMA user_version = 1")
    for _ in range(2):  # opened twice: migrated once
        registry = Registry(tmp_path)
        assert [(v.version, v.adapter_id, v.current, v.created_at) for v in
                registry.versions("a")] == [(1, "1" * 64, True, 5.0)]
        current = registry.get("a")
        assert current is not None and current.pinned
        registry.close()


_REREGISTER_FOREVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from lorastream.store.registry import Registry, RegistryEntry

    registry = Registry(Path(sys.argv[1]))
    i = 0
    while True:
        name = f"n{i % 3}"
        registry.put(RegistryEntry(name, f"{i:064x}", f"push://{name}", "", 1.0, 1.0))
        print(i, flush=True)
        i += 1
    """
)


@pytest.mark.parametrize("acks_before_kill", [1, 60])
def test_a_sigkill_during_re_registration_leaves_names_and_history_in_step(
    tmp_path: Path, acks_before_kill: int
) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _REREGISTER_FOREVER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    acknowledged = [int(proc.stdout.readline()) for _ in range(acks_before_kill)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    registry = Registry(tmp_path)
    written = [int(v.adapter_id, 16) for n in ("n0", "n1", "n2") for v in registry.versions(n)]
    assert set(acknowledged) <= set(written)
    assert sorted(written) == list(range(len(written)))  # no gap, nothing half-written
    for name in ("n0", "n1", "n2"):
        history = registry.versions(name)
        assert [v.version for v in history] == list(range(len(history), 0, -1))
        current = registry.get(name)
        assert current is None or current.adapter_id == history[0].adapter_id


# -- over gRPC and the CLI ----------------------------------------------------------------------
@pytest.mark.parametrize("token, rollback_allowed", [(READ, False), (OPERATE, True)])
def test_history_reads_and_rollback_operates_through_the_cli(
    tmp_path: Path, variants: list[Path], token: str, rollback_allowed: bool
) -> None:
    server, port, _ = create_server(StoreSettings(
        port=0, cache_dir=tmp_path / "cache", token=OPERATE, read_token=READ,
        allowed_local_roots=[tmp_path],
    ))
    server.start()
    target = f"127.0.0.1:{port}"
    try:
        with StoreClient(target, OPERATE) as client:
            ids = [list(client.preload(str(v), "x", force=True))[-1].manifest.adapter_id
                   for v in variants[:2]]
        run = CliRunner().invoke
        shown = run(app, ["adapters", "history", "x", "--store", target, "--token", token])
        assert shown.exit_code == 0, shown.output
        assert "v2" in shown.output and ids[1][:12] in shown.output and "current" in shown.output
        back = run(app, ["adapters", "rollback", "x", "v1", "--store", target, "--token", token])
        with StoreClient(target, READ) as client:
            current = client.describe("x").adapter_id
            pinned = client.describe(f"x@{ids[1][:6]}").adapter_id
        assert pinned == ids[1]
        if rollback_allowed:
            assert back.exit_code == 0, back.output
            assert "rolled back x" in back.output and current == ids[0]
        else:
            assert back.exit_code != 0 and "operate" in back.output and current == ids[1]
    finally:
        server.stop(None).wait()


def test_parse_ref_splits_at_the_at_sign() -> None:
    assert (parse_ref("org/a").name, parse_ref("org/a").pinned) == ("org/a", False)
    assert (parse_ref("org/a@3f2").name, parse_ref("org/a@3f2").prefix) == ("org/a", "3f2")
    with pytest.raises(errors.InvalidArgument, match=r"lowercase hex"):
        parse_ref("org/a@")
