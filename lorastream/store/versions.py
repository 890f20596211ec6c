"""Which version of a name a pinned reference or a rollback means (plain functions over a name's
history, newest first, as ``Registry.versions`` returns it).

Example: ``a`` has v1 ``3f2a..``, v2 ``3f9c..``, v3 ``b71e..`` (current). ``a@b7`` is v3, ``a@3f``
is ambiguous (two content ids), ``a@3f9`` is v2; a rollback with no version goes to v2 (the content
before the current one) and appends it as v4.
"""

from __future__ import annotations

import time

from lorastream.core.errors import AdapterNotFound, InvalidArgument
from lorastream.core.versions import AdapterVersion, VersionSelector, parse_ref
from lorastream.store.names import validate_name
from lorastream.store.registry import Registry, RegistryEntry


def _no_such_name(name: str) -> AdapterNotFound:
    return AdapterNotFound(f"no adapter named {name!r}; preload it first (adapters ls)")


def _staged(name: str, version: AdapterVersion) -> AdapterVersion:
    if not version.staged:
        raise AdapterNotFound(
            f"version v{version.version} of {name} ({version.adapter_id[:12]}) was evicted from "
            "the store's cache; preload or push it again"
        )
    return version


def pick_prefix(name: str, prefix: str, history: list[AdapterVersion]) -> AdapterVersion:
    """The staged version of ``name`` whose content id starts with ``prefix``.

    AdapterNotFound when none does (or it was evicted); InvalidArgument, counting the
    candidates, when several content ids do."""
    matches = [v for v in history if v.adapter_id.startswith(prefix)]
    ids = list(dict.fromkeys(v.adapter_id for v in matches))  # newest first, distinct
    if not ids:
        raise AdapterNotFound(
            f"no version of {name!r} has a content id starting with {prefix!r}; "
            f"'lorastream adapters history {name}' lists its versions"
        )
    if len(ids) > 1:
        raise InvalidArgument(
            f"{name}@{prefix} is ambiguous: {len(ids)} versions have content ids starting with "
            f"{prefix!r} ({', '.join(i[:12] for i in ids)}); give more characters"
        )
    return _staged(name, matches[0])


def pick_rollback(name: str, selector: VersionSelector, history: list[AdapterVersion]
                  ) -> AdapterVersion:
    """The version a rollback of ``name`` goes to (see ``VersionSelector``); it must be staged."""
    if not history:
        raise _no_such_name(name)
    if selector.prefix:
        return pick_prefix(name, selector.prefix, history)
    if selector.number:
        for version in history:
            if version.version == selector.number:
                return _staged(name, version)
        raise AdapterNotFound(
            f"{name} has no version v{selector.number} (its versions are v1 to "
            f"v{history[0].version}); 'lorastream adapters history {name}' lists them"
        )
    current = history[0].adapter_id if history[0].current else None
    for version in history:
        if version.adapter_id != current:
            return _staged(name, version)
    raise InvalidArgument(
        f"{name} has no earlier content to roll back to: every version is {current}"
    )


def entry_for_ref(registry: Registry, ref: str) -> RegistryEntry:
    """The registry entry ``name@prefix`` stands for: that version's content under ``name``,
    pinned only if it is the name's current, pinned content."""
    parsed = parse_ref(ref)
    validate_name(parsed.name)
    version = pick_prefix(parsed.name, parsed.prefix, registry.versions(parsed.name, parsed.prefix))
    current = registry.get(parsed.name)
    pinned = current is not None and current.adapter_id == version.adapter_id and current.pinned
    return RegistryEntry(parsed.name, version.adapter_id, version.source_uri, version.revision,
                         version.created_at, time.time(), pinned)
