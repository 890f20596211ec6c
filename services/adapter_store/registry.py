"""The persistent name registry and the disk budget's eviction policy.

``cache/registry.json`` maps each name to a content id with its source, revision, pin flag and
last use; it is rewritten atomically (temp file, fsync, ``os.replace``) on every change, so it
survives restarts and crashes. Sizes are not persisted: the store measures the staged directories
at startup.

Eviction works on content ids, not names: a content id is evictable when none of its names is
pinned and nobody streams it; the least recently used (latest use among its names) goes first,
and with it every name that points at it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lorastream.core.errors import CapacityExhausted, InvalidArgument

log = logging.getLogger(__name__)

REGISTRY_FILE = "registry.json"
_FORMAT = 1
MAX_NAME_LENGTH = 128
_NAME = re.compile(r"[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*")


def validate_name(name: str) -> str:
    """Adapter names: ``/``-separated segments of letters, digits, ``.``, ``_``, ``-``."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument("adapter name is empty")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidArgument(f"adapter name is {len(name)} characters; at most {MAX_NAME_LENGTH}")
    if not _NAME.fullmatch(name) or any(set(seg) == {"."} for seg in name.split("/")):
        raise InvalidArgument(
            f"invalid adapter name {name!r}: use segments of letters, digits, '.', '_', '-' "
            "separated by '/', with no leading '/' and no '.' or '..' segments"
        )
    return name


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


class Registry:
    """name -> RegistryEntry plus the bytes of each staged content id. Not thread-safe."""

    def __init__(self, cache_dir: Path) -> None:
        self.path = cache_dir / REGISTRY_FILE
        self.entries: dict[str, RegistryEntry] = {}
        self.sizes: dict[str, int] = {}  # adapter_id -> bytes on disk
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        try:
            doc = json.loads(self.path.read_text())
            if doc.get("format") != _FORMAT:
                raise ValueError(f"unknown format {doc.get('format')!r}")
            entries = [RegistryEntry(**e) for e in doc["names"]]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise InvalidArgument(
                f"adapter registry {self.path} is unreadable ({err}); move it away to start with "
                "an empty cache"
            ) from err
        self.entries = {e.name: e for e in entries}

    def save(self) -> None:
        """Write the registry atomically; a full disk raises CapacityExhausted."""
        doc = {
            "format": _FORMAT,
            "names": [dataclasses.asdict(e) for e in sorted(self.entries.values(), key=_by_name)],
        }
        temp = self.path.with_name(f".{REGISTRY_FILE}.{os.getpid()}.tmp")
        try:
            with temp.open("w") as f:
                json.dump(doc, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, self.path)
        except OSError as err:
            temp.unlink(missing_ok=True)
            if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise CapacityExhausted(
                    f"disk full while saving the adapter registry {self.path} ({err})"
                ) from err
            raise

    # -- queries ----------------------------------------------------------------------------
    @property
    def bytes_used(self) -> int:
        return sum(self.sizes.values())

    def names_of(self, adapter_id: str) -> list[str]:
        return sorted(e.name for e in self.entries.values() if e.adapter_id == adapter_id)

    def is_referenced(self, adapter_id: str) -> bool:
        return any(e.adapter_id == adapter_id for e in self.entries.values())

    def pinned_names(self) -> list[str]:
        return sorted(e.name for e in self.entries.values() if e.pinned)

    def eviction_order(self, protected: Iterable[str]) -> list[str]:
        """Evictable content ids, least recently used first.

        ``protected`` are ids that must stay (being streamed, being committed, or already going).
        """
        keep = set(protected)
        last_used: dict[str, float] = {}
        pinned: set[str] = set()
        for e in self.entries.values():
            last_used[e.adapter_id] = max(last_used.get(e.adapter_id, 0.0), e.last_used_at)
            if e.pinned:
                pinned.add(e.adapter_id)
        candidates = [
            aid for aid in self.sizes if aid not in pinned and aid not in keep
        ]
        return sorted(candidates, key=lambda aid: (last_used.get(aid, 0.0), aid))

    def plan_eviction(self, need: int, budget: int, protected: Iterable[str]) -> list[str]:
        """Content ids to evict, LRU first, so that ``need`` more bytes fit in ``budget``.

        Raises CapacityExhausted (naming the budget and what holds it) when even evicting every
        evictable id would not be enough.
        """
        protected = set(protected)
        free = budget - self.bytes_used
        plan: list[str] = []
        for aid in self.eviction_order(protected):
            if free >= need:
                break
            plan.append(aid)
            free += self.sizes[aid]
        if free >= need:
            return plan
        pinned = self.pinned_names()
        streamed = sorted(n for aid in protected for n in self.names_of(aid))
        raise CapacityExhausted(
            f"adapter cache budget {budget} bytes cannot fit {need} more bytes: "
            f"{self.bytes_used} bytes are staged; pinned: {', '.join(pinned) or 'none'}; "
            f"in use: {', '.join(streamed) or 'none'}. Unpin or delete adapters, or raise the "
            "cache budget (--cache-bytes)"
        )


def _by_name(entry: RegistryEntry) -> str:
    return entry.name
