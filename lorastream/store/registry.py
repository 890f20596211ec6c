"""The persistent name registry (SQLite).

``cache/registry.sqlite3`` maps each name to a content id with its source, revision, pin flag and
last use. Every change is one SQLite transaction in WAL mode with ``synchronous=FULL``: a
registration costs one small append to the write-ahead log, however many names there are (the
JSON file it replaces was rewritten and fsynced whole on every change, a cost that grew with the
names; docs/notes/store.md, "The registry: from one JSON file to SQLite"), and a process killed at
any moment loses no acknowledged change and leaves no half-written one. Sizes are not persisted: the
store measures the staged directories at startup.

Every registration that changes what a name points at appends a row to ``versions`` (the name's
history: 1, 2, 3, ...) in the same transaction; a rollback appends the version it goes back to.
History rows outlive their files: evicted content stays listed (not staged) until the name is
deleted.

A ``registry.json`` from earlier versions is imported on first start, in one transaction, then
renamed to ``registry.json.migrated``; a schema 1 database (names only) gets its history table in
one transaction, each name's current content as its version 1.

It also keeps, in memory (``content_use.py``), what the disk budget's eviction policy
(``eviction.py``) reads of each staged content id: its bytes, its last use and whether a pinned
name points at it, and the LRU order. Each change refreshes the content ids it touched with one
indexed query, so no registration reads every name (the cost stays flat in the number of names).

Not thread-safe: the store calls it under its own lock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from lorastream.core.errors import CapacityExhausted, InvalidArgument
from lorastream.core.listing import AdapterFilter
from lorastream.core.versions import AdapterVersion
from lorastream.store.content_use import ContentUse

log = logging.getLogger(__name__)

REGISTRY_FILE = "registry.sqlite3"
LEGACY_FILE = "registry.json"  # format 1, before SQLite
_LEGACY_FORMAT = 1
_SCHEMA_VERSION = 2  # 1: names only; 2: names and their versions
_COLUMNS = "name, adapter_id, source_uri, revision, created_at, last_used_at, pinned"
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS names (
        name TEXT PRIMARY KEY,
        adapter_id TEXT NOT NULL,
        source_uri TEXT NOT NULL,
        revision TEXT NOT NULL,
        created_at REAL NOT NULL,
        last_used_at REAL NOT NULL,
        pinned INTEGER NOT NULL CHECK (pinned IN (0, 1))
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS names_by_adapter ON names (adapter_id)",
    """CREATE TABLE IF NOT EXISTS versions (
        name TEXT NOT NULL,
        version INTEGER NOT NULL,
        adapter_id TEXT NOT NULL,
        source_uri TEXT NOT NULL,
        revision TEXT NOT NULL,
        created_at REAL NOT NULL,
        last_used_at REAL NOT NULL,
        PRIMARY KEY (name, version)
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS versions_by_adapter ON versions (adapter_id)",
)
_VERSION_COLUMNS = "name, version, adapter_id, source_uri, revision, created_at"
# One content id's latest use and pin, through the adapter_id indexes (what eviction reads).
_USE_OF = (
    "SELECT MAX(used), MAX(pinned) FROM (SELECT last_used_at AS used, pinned FROM names WHERE "
    "adapter_id = ?1 UNION ALL SELECT last_used_at, 0 FROM versions WHERE adapter_id = ?1)"
)
_IDS_OF_NAME = "SELECT adapter_id FROM names WHERE name = ?"
_IDS_OF_HISTORY = "SELECT adapter_id FROM versions WHERE name = ?"
# Names without history (a schema 1 database, a legacy import) get their content as version 1.
_BACKFILL = (
    "INSERT INTO versions (name, version, adapter_id, source_uri, revision, created_at, "
    "last_used_at) SELECT name, 1, adapter_id, source_uri, revision, created_at, last_used_at "
    "FROM names WHERE NOT EXISTS (SELECT 1 FROM versions v WHERE v.name = names.name)"
)


@dataclass
class RegistryEntry:
    """One registered name."""

    name: str
    adapter_id: str
    source_uri: str
    revision: str
    created_at: float  # unix seconds when the name was registered
    last_used_at: float
    pinned: bool = False


def _row(row: tuple[str, str, str, str, float, float, int]) -> RegistryEntry:
    name, adapter_id, uri, revision, created, used, pinned = row
    return RegistryEntry(name, adapter_id, uri, revision, created, used, bool(pinned))


def _like_prefix(prefix: str) -> str:
    """A LIKE pattern matching strings that start with ``prefix`` (escape: backslash)."""
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"{escaped}%"


class Registry:
    """name -> RegistryEntry in SQLite, plus each staged content id's bytes and use."""

    def __init__(self, cache_dir: Path) -> None:
        self.path = Path(cache_dir) / REGISTRY_FILE
        self.sizes = ContentUse()  # adapter_id -> bytes on disk; written by set_size/drop_size
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > _SCHEMA_VERSION:
                raise sqlite3.DatabaseError(
                    f"schema version {version} is newer than this lorastream's {_SCHEMA_VERSION}"
                )
            with self._write():
                for statement in _SCHEMA:
                    self._db.execute(statement)
                if version < 2:
                    self._db.execute(_BACKFILL)
                self._db.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
        except sqlite3.DatabaseError as err:
            raise InvalidArgument(
                f"adapter registry {self.path} is unreadable ({err}); move it away to start with "
                "an empty cache"
            ) from err
        self._migrate_legacy()

    def close(self) -> None:
        self._db.close()

    def checkpoint(self) -> None:
        """Fold the write-ahead log into the database file and truncate it (SQLite also does
        this by itself every 1000 pages; benchmarks call it so that every count starts alike)."""
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    # -- changes: each one transaction --------------------------------------------------------
    def put(self, entry: RegistryEntry) -> None:
        """Register ``entry.name`` (replacing what it pointed at; a new content id is a new
        version)."""
        self.put_many([entry])

    def put_many(self, entries: Iterable[RegistryEntry]) -> None:
        """Register every one of ``entries`` in one transaction: all of them, or none."""
        touched: set[str] = set()
        with self._write():
            for entry in entries:
                old = self.get(entry.name)
                self._insert([entry])
                if old is None or old.adapter_id != entry.adapter_id:
                    self._append_version(entry, old)
                touched.update(self._staged_ids(entry, old))
        self._refresh(touched)

    def rollback(self, name: str, target: AdapterVersion, when: float) -> RegistryEntry:
        """Point ``name`` at ``target``'s content again, appended as its newest version (one
        transaction); the name keeps its pin. Returns the new entry."""
        old = self.get(name)
        entry = RegistryEntry(name, target.adapter_id, target.source_uri, target.revision, when,
                              when, old.pinned if old is not None else False)
        with self._write():
            self._insert([entry])
            self._append_version(entry, old)
        self._refresh(self._staged_ids(entry, old))
        return entry

    def delete(self, names: Iterable[str]) -> None:
        """Forget ``names`` (those that exist) and their history, all in one transaction."""
        rows = [(n,) for n in names]
        touched = self._ids_of(rows, _IDS_OF_NAME, _IDS_OF_HISTORY)
        with self._write():
            self._db.executemany("DELETE FROM names WHERE name = ?", rows)
            self._db.executemany("DELETE FROM versions WHERE name = ?", rows)
        self._refresh(touched)

    def drop_current(self, names: Iterable[str]) -> None:
        """Unbind ``names`` from their current content (evicted or lost), keeping their
        history, in one transaction."""
        rows = [(n,) for n in names]
        touched = self._ids_of(rows, _IDS_OF_NAME)
        with self._write():
            self._db.executemany("DELETE FROM names WHERE name = ?", rows)
        self._refresh(touched)

    def set_pinned(self, name: str, pinned: bool) -> None:
        with self._write():
            self._db.execute("UPDATE names SET pinned = ? WHERE name = ?", (int(pinned), name))
        self._refresh(self._ids_of([(name,)], _IDS_OF_NAME))

    def touch(self, name: str, when: float) -> None:
        """Record a use of ``name`` at ``when`` (unix seconds)."""
        with self._write():
            self._db.execute("UPDATE names SET last_used_at = ? WHERE name = ?", (when, name))
        self._refresh(self._ids_of([(name,)], _IDS_OF_NAME))

    def touch_version(self, name: str, adapter_id: str, when: float) -> None:
        """Record a use of ``name``'s version(s) with ``adapter_id`` (a pinned stream), and of
        the name itself when that is its current content."""
        with self._write():
            for table in ("versions", "names"):
                self._db.execute(
                    f"UPDATE {table} SET last_used_at = ? WHERE name = ? AND adapter_id = ?",
                    (when, name, adapter_id),
                )
        self._refresh([adapter_id])

    # -- queries ------------------------------------------------------------------------------
    def get(self, name: str) -> RegistryEntry | None:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM names WHERE name = ?", (name,)).fetchone()
        return None if row is None else _row(row)

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM names").fetchone()[0])

    def current_versions(self) -> list[tuple[str, str, int]]:
        """(name, content id, version number) of every name, in name order: a watch's
        snapshot."""
        rows = self._db.execute(
            "SELECT n.name, n.adapter_id, (SELECT MAX(v.version) FROM versions v WHERE "
            "v.name = n.name) FROM names n ORDER BY n.name"
        )
        return [(name, adapter_id, int(version or 0)) for name, adapter_id, version in rows]

    def matching(
        self, where: AdapterFilter = AdapterFilter(), after: str = "", limit: int | None = None
    ) -> list[RegistryEntry]:
        """Names matching ``where`` in name order, those after ``after``, at most ``limit``."""
        sql, args = self._matching(f"SELECT {_COLUMNS} FROM names", where, after)
        sql += " ORDER BY name"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        return [_row(r) for r in self._db.execute(sql, args)]

    def count(self, where: AdapterFilter = AdapterFilter()) -> int:
        sql, args = self._matching("SELECT COUNT(*) FROM names", where, "")
        return int(self._db.execute(sql, args).fetchone()[0])

    @staticmethod
    def _matching(select: str, where: AdapterFilter, after: str) -> tuple[str, list[object]]:
        sql = f"{select} WHERE name > ?"
        args: list[object] = [after]
        if where.prefix:
            sql += " AND name LIKE ? ESCAPE '\\'"
            args.append(_like_prefix(where.prefix))
        if where.pinned is not None:
            sql += " AND pinned = ?"
            args.append(int(where.pinned))
        if where.source_prefix:
            sql += " AND source_uri LIKE ? ESCAPE '\\'"
            args.append(_like_prefix(where.source_prefix))
        return sql, args

    @property
    def bytes_used(self) -> int:
        return self.sizes.bytes_used

    def set_size(self, adapter_id: str, size: int) -> None:
        """``adapter_id`` is staged with ``size`` bytes on disk (its use is read once, here)."""
        used, pinned = self._use_of(adapter_id)
        self.sizes.staged(adapter_id, size, used, pinned)

    def drop_size(self, adapter_id: str) -> None:
        """``adapter_id``'s files are gone."""
        self.sizes.gone(adapter_id)

    def names_of(self, adapter_id: str) -> list[str]:
        rows = self._db.execute(
            "SELECT name FROM names WHERE adapter_id = ? ORDER BY name", (adapter_id,)
        )
        return [r[0] for r in rows]

    def is_referenced(self, adapter_id: str) -> bool:
        """True when a name points at ``adapter_id`` or a name's history holds it."""
        for table in ("names", "versions"):
            row = self._db.execute(
                f"SELECT 1 FROM {table} WHERE adapter_id = ? LIMIT 1", (adapter_id,)
            )
            if row.fetchone() is not None:
                return True
        return False

    def versions(self, name: str, prefix: str = "") -> list[AdapterVersion]:
        """``name``'s history, newest first; only content ids starting with ``prefix``."""
        rows = self._db.execute(
            f"SELECT {_VERSION_COLUMNS} FROM versions WHERE name = ? AND adapter_id LIKE ? "
            "ESCAPE '\\' ORDER BY version DESC",
            (name, _like_prefix(prefix)),
        ).fetchall()
        current = self.get(name)
        latest = self.latest_version(name)
        return [
            AdapterVersion(
                name=n, version=v, adapter_id=aid, source_uri=uri, revision=rev,
                created_at=created,
                current=current is not None and v == latest and aid == current.adapter_id,
                staged=aid in self.sizes, total_bytes=self.sizes.get(aid, 0),
            )
            for n, v, aid, uri, rev, created in rows
        ]

    # -- the staged contents' use (content_use.py), refreshed after each change ------------------
    def _use_of(self, adapter_id: str) -> tuple[float, bool]:
        """(latest use among the names and versions holding ``adapter_id``, whether a name
        pointing at it is pinned); (0.0, False) when nothing refers to it."""
        used, pinned = self._db.execute(_USE_OF, (adapter_id,)).fetchone()
        return float(used or 0.0), bool(pinned)

    def _refresh(self, adapter_ids: Iterable[str]) -> None:
        for adapter_id in adapter_ids:
            if adapter_id in self.sizes:
                self.sizes.use(adapter_id, *self._use_of(adapter_id))

    def _staged_ids(self, *entries: RegistryEntry | None) -> set[str]:
        return {e.adapter_id for e in entries if e is not None and e.adapter_id in self.sizes}

    def _ids_of(self, rows: list[tuple[str]], *queries: str) -> set[str]:
        """The staged content ids the names in ``rows`` refer to, by ``queries`` (indexed)."""
        return {aid for row in rows for query in queries
                for (aid,) in self._db.execute(query, row) if aid in self.sizes}

    # -- internals ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _write(self) -> Iterator[None]:
        """One transaction; a full disk raises CapacityExhausted and changes nothing."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        except sqlite3.OperationalError as err:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            if "full" in str(err).lower():
                raise CapacityExhausted(
                    f"disk full while saving the adapter registry {self.path} ({err})"
                ) from err
            raise

    def _insert(self, entries: Iterable[RegistryEntry], on_conflict: str = "REPLACE") -> None:
        self._db.executemany(
            f"INSERT OR {on_conflict} INTO names ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(e.name, e.adapter_id, e.source_uri, e.revision, e.created_at, e.last_used_at,
              int(e.pinned)) for e in entries],
        )

    def latest_version(self, name: str) -> int:
        """The newest version number of ``name``'s history; 0 when it has none."""
        row = self._db.execute("SELECT MAX(version) FROM versions WHERE name = ?", (name,))
        return int(row.fetchone()[0] or 0)

    def _append_version(self, entry: RegistryEntry, old: RegistryEntry | None) -> None:
        """Append ``entry``'s content to its name's history; the version it supersedes keeps
        the name's last use as its own (the disk budget's LRU reads it)."""
        if old is not None:
            self._db.execute(
                "UPDATE versions SET last_used_at = MAX(last_used_at, ?) WHERE name = ? AND "
                "adapter_id = ?", (old.last_used_at, old.name, old.adapter_id),
            )
        self._db.execute(
            "INSERT INTO versions (name, version, adapter_id, source_uri, revision, created_at, "
            "last_used_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (entry.name, self.latest_version(entry.name) + 1, entry.adapter_id,
             entry.source_uri, entry.revision, entry.created_at, entry.last_used_at),
        )

    def _migrate_legacy(self) -> None:
        """Import ``registry.json`` (format 1) once, then rename it out of the way."""
        legacy = self.path.with_name(LEGACY_FILE)
        if not legacy.exists():
            return
        try:
            doc = json.loads(legacy.read_text())
            if doc.get("format") != _LEGACY_FORMAT:
                raise ValueError(f"unknown format {doc.get('format')!r}")
            entries = [RegistryEntry(**e) for e in doc["names"]]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise InvalidArgument(
                f"adapter registry {legacy} is unreadable ({err}); move it away to start with "
                "an empty cache"
            ) from err
        with self._write():
            # A migration interrupted before the rename is run again: what it wrote stays.
            self._insert(entries, on_conflict="IGNORE")
            self._db.execute(_BACKFILL)
        legacy.replace(legacy.with_name(f"{LEGACY_FILE}.migrated"))
        log.info("adapter registry: imported %d names from %s into %s", len(entries), legacy,
                 self.path)
