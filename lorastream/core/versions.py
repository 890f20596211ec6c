"""Adapter versions and references: shared by the store, its client, the CLI and the worker.

A name points at one content id at a time (its current version); every registration that changes
what it points at appends a version to its history (1, 2, 3, ...). A request names either the
current version, ``name``, or a pinned one, ``name@<content-id prefix>``: ``@`` never occurs in a
name (``lorastream.store.names.validate_name``), so the split is unambiguous.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from lorastream.core.errors import InvalidArgument

_HEX = re.compile(r"[0-9a-f]+")
_VERSION_NUMBER = re.compile(r"v([0-9]+)")


@dataclass(frozen=True)
class AdapterVersion:
    """One entry of a name's history."""

    name: str
    version: int  # 1 for the first registration of the name, then 2, 3, ...
    adapter_id: str
    source_uri: str
    revision: str
    created_at: float  # unix seconds when this version was registered
    current: bool  # the name points at this version now
    staged: bool  # its files are in the store's cache (False: evicted, history only)
    total_bytes: int = 0  # 0 when evicted


@dataclass(frozen=True)
class AdapterRef:
    """What a request names: ``name`` (``prefix`` empty: the current version) or
    ``name@prefix`` (the version whose content id starts with ``prefix``)."""

    name: str
    prefix: str = ""

    @property
    def pinned(self) -> bool:
        return bool(self.prefix)

    def __str__(self) -> str:
        return f"{self.name}@{self.prefix}" if self.prefix else self.name


def parse_ref(ref: str) -> AdapterRef:
    """Split ``name@prefix``; InvalidArgument when the prefix is not lowercase hex."""
    name, at, prefix = ref.partition("@")
    if not at:
        return AdapterRef(ref)
    if not _HEX.fullmatch(prefix):
        raise InvalidArgument(
            f"{ref!r}: after '@' give the start of a content id (lowercase hex, as "
            "'lorastream adapters history NAME' shows it)"
        )
    return AdapterRef(name, prefix)


def pinned_ref(name: str, adapter_id: str) -> str:
    """The reference that names exactly ``adapter_id``'s version of ``name``."""
    return f"{parse_ref(name).name}@{adapter_id}"


@dataclass(frozen=True)
class VersionSelector:
    """Which version a rollback goes to: a version number (``v3``), a content id prefix, or
    (both empty) the content the name pointed at before its current one."""

    number: int = 0
    prefix: str = ""


def parse_version(text: str | None) -> VersionSelector:
    """``None`` or ``""``: the previous content; ``vN``: version N; else a content id prefix."""
    if not text:
        return VersionSelector()
    number = _VERSION_NUMBER.fullmatch(text)
    if number:
        return VersionSelector(number=int(number.group(1)))
    if not _HEX.fullmatch(text):
        raise InvalidArgument(
            f"version {text!r}: give vN (a version number from 'lorastream adapters history') "
            "or the start of a content id (lowercase hex)"
        )
    return VersionSelector(prefix=text)


class ChangeKind(enum.Enum):
    """What happened to a name, as a watch reports it."""

    PUT = "put"  # a name appeared (or is in the snapshot)
    VERSION = "version"  # a name now points at other content (re-register, push, rollback)
    DELETE = "delete"  # a name is gone (deleted, or its content evicted)


@dataclass(frozen=True)
class AdapterChange:
    kind: ChangeKind
    name: str
    adapter_id: str = ""  # empty for DELETE
    version: int = 0  # the name's version number; 0 for DELETE


@dataclass(frozen=True)
class WatchMessage:
    """One message of a WatchAdapters stream: a page of the snapshot, or changes."""

    watch_id: str
    generation: int  # the store's change counter once ``changes`` are applied
    changes: tuple[AdapterChange, ...] = ()
    snapshot: bool = False
    snapshot_done: bool = False
