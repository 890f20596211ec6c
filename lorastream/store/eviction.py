"""The disk budget's eviction policy: which staged content goes to make room, in which order.

Eviction works on content ids, not names: a content id is evictable when none of the names that
point at it now is pinned and nobody streams it; old versions are unpinned content like any other.
The least recently used (latest use among its names and versions) goes first, and with it every
name that points at it now (their history stays).

Plain functions over the :class:`~lorastream.store.registry.Registry`, which holds what they read
(each content id's size, last use and pins, and their LRU order, kept as they change:
``content_use.py``); they only decide. The staged contents
(``staged_contents.py``) carry a plan out, under the store's lock.
"""

from __future__ import annotations

from collections.abc import Iterable

from lorastream.core.errors import CapacityExhausted
from lorastream.core.listing import AdapterFilter
from lorastream.store.registry import Registry

__all__ = ["eviction_order", "plan_eviction"]

_NAMED = 20  # names listed in a CapacityExhausted message


def eviction_order(registry: Registry, protected: Iterable[str] = ()) -> list[str]:
    """Every evictable content id, least recently used first (O(n log n): for tests and
    reports; :func:`plan_eviction` takes only what it needs).

    ``protected`` are ids that must stay (being streamed, being committed, or already going).
    """
    return registry.sizes.order(set(protected))


def plan_eviction(
    registry: Registry, need: int, budget: int, protected: Iterable[str]
) -> list[str]:
    """Content ids to evict, LRU first, so that ``need`` more bytes fit in ``budget``.

    Costs nothing over the content ids when ``need`` fits already, and otherwise O(log n) per id
    it takes (``content_use.py``): a registration costs the same at any number of names.
    Raises CapacityExhausted (naming the budget and what holds it) when even evicting every
    evictable id would not be enough.
    """
    free = budget - registry.bytes_used
    if free >= need:
        return []
    protected = set(protected)
    plan, freed = registry.sizes.take(need - free, protected)
    if free + freed >= need:
        return plan
    pinned = [e.name for e in registry.matching(AdapterFilter(pinned=True), limit=_NAMED + 1)]
    streamed = sorted(n for aid in protected for n in registry.names_of(aid))
    raise CapacityExhausted(
        f"adapter cache budget {budget} bytes cannot fit {need} more bytes: "
        f"{registry.bytes_used} bytes are staged; pinned: {_some(pinned)}; "
        f"in use: {_some(streamed)}. Unpin or delete adapters, or raise the "
        "cache budget (--cache-bytes)"
    )


def _some(names: list[str]) -> str:
    """At most ``_NAMED`` names for a message (a store may hold 100,000)."""
    shown = ", ".join(names[:_NAMED]) or "none"
    return f"{shown}, ..." if len(names) > _NAMED else shown
