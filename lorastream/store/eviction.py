"""The disk budget's eviction policy: which staged content goes to make room, in which order.

Eviction works on content ids, not names: a content id is evictable when none of the names that
point at it now is pinned and nobody streams it; old versions are unpinned content like any other.
The least recently used (latest use among its names and versions) goes first, and with it every
name that points at it now (their history stays).

Plain functions over the :class:`~lorastream.store.registry.Registry`, which holds what they read
(each content id's size, last use and pins); they only decide. The staged contents
(``staged_contents.py``) carry a plan out, under the store's lock.
"""

from __future__ import annotations

from collections.abc import Iterable

from lorastream.core.errors import CapacityExhausted
from lorastream.core.listing import AdapterFilter
from lorastream.store.registry import Registry

__all__ = ["eviction_order", "plan_eviction"]


def eviction_order(registry: Registry, protected: Iterable[str]) -> list[str]:
    """Evictable content ids, least recently used first.

    ``protected`` are ids that must stay (being streamed, being committed, or already going).
    """
    keep = set(protected)
    last_used: dict[str, float] = {}
    pinned: set[str] = set()
    for adapter_id, (used, any_pinned) in registry.content_use().items():
        last_used[adapter_id] = used
        if any_pinned:
            pinned.add(adapter_id)
    candidates = [aid for aid in registry.sizes if aid not in pinned and aid not in keep]
    return sorted(candidates, key=lambda aid: (last_used.get(aid, 0.0), aid))


def plan_eviction(
    registry: Registry, need: int, budget: int, protected: Iterable[str]
) -> list[str]:
    """Content ids to evict, LRU first, so that ``need`` more bytes fit in ``budget``.

    Raises CapacityExhausted (naming the budget and what holds it) when even evicting every
    evictable id would not be enough.
    """
    protected = set(protected)
    free = budget - registry.bytes_used
    plan: list[str] = []
    for aid in eviction_order(registry, protected):
        if free >= need:
            break
        plan.append(aid)
        free += registry.sizes[aid]
    if free >= need:
        return plan
    pinned = [e.name for e in registry.matching(AdapterFilter(pinned=True))]
    streamed = sorted(n for aid in protected for n in registry.names_of(aid))
    raise CapacityExhausted(
        f"adapter cache budget {budget} bytes cannot fit {need} more bytes: "
        f"{registry.bytes_used} bytes are staged; pinned: {', '.join(pinned) or 'none'}; "
        f"in use: {', '.join(streamed) or 'none'}. Unpin or delete adapters, or raise the "
        "cache budget (--cache-bytes)"
    )
