"""The disk budget's view of the staged contents, kept as the registry changes
(``lorastream/store/content_use.py``), against the same figures recomputed from SQLite over every
name and version (what eviction ran on every staging before the registry kept this view) after
each of a few hundred random changes to a real registry."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from lorastream.store.eviction import plan_eviction
from lorastream.store.registry import Registry, RegistryEntry

_EVERY_CONTENT = (
    "SELECT adapter_id, MAX(used), MAX(pinned) FROM (SELECT adapter_id, last_used_at AS used, "
    "pinned FROM names UNION ALL SELECT adapter_id, last_used_at, 0 FROM versions) "
    "GROUP BY adapter_id"
)


def _recomputed(registry: Registry) -> tuple[list[str], int]:
    """(evictable staged ids, LRU first; bytes staged) from every row."""
    rows = registry._db.execute(_EVERY_CONTENT).fetchall()
    use = {aid: (used, bool(pinned)) for aid, used, pinned in rows}
    staged = dict(registry.sizes)
    evictable = [aid for aid in staged if not use.get(aid, (0.0, False))[1]]
    order = sorted(evictable, key=lambda aid: (use.get(aid, (0.0, False))[0], aid))
    return order, sum(staged.values())


def _entry(name: str, adapter_id: str, when: float, pinned: bool = False) -> RegistryEntry:
    return RegistryEntry(name, adapter_id, f"s3://b/{name}", "", when, when, pinned)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_kept_lru_order_and_bytes_match_a_full_recount(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    registry = Registry(tmp_path)
    names = [f"n{i}" for i in range(12)]
    ids = [f"{i:064x}" for i in range(20)]
    clock = 1000.0
    for _ in range(400):
        clock += rng.choice([0.0, 1.0])  # ties too: the order breaks them by content id
        op = rng.randrange(8)
        name, aid = rng.choice(names), rng.choice(ids)
        current = registry.get(name)
        if op == 0:
            registry.set_size(aid, rng.randrange(1, 100))
        elif op == 1:
            registry.drop_size(aid)
        elif op == 2:
            registry.put(_entry(name, aid, clock, pinned=rng.random() < 0.2))
        elif op == 3 and current is not None:
            registry.touch(name, clock)
        elif op == 4 and current is not None:
            registry.set_pinned(name, not current.pinned)
        elif op == 5:
            registry.drop_current([name])
        elif op == 6 and rng.random() < 0.3:
            registry.delete([name])
        elif op == 7 and current is not None:
            registry.touch_version(name, current.adapter_id, clock)
        order, used = _recomputed(registry)
        assert registry.sizes.order() == order
        assert registry.bytes_used == used
        need = rng.randrange(0, 200)
        taken, freed = registry.sizes.take(need, protected=())
        prefix, total = [], 0
        for candidate in order:  # the LRU prefix that frees ``need``
            if total >= need:
                break
            prefix.append(candidate)
            total += registry.sizes[candidate]
        assert (taken, freed) == (prefix, total)


def test_eviction_takes_lru_first_and_skips_protected_and_pinned(tmp_path: Path) -> None:
    registry = Registry(tmp_path)
    a, b, c, d = (f"{i:064x}" for i in range(4))
    for aid in (a, b, c, d):
        registry.set_size(aid, 10)
    registry.put(_entry("a", a, 5.0))
    registry.put(_entry("b", b, 3.0))
    registry.put(_entry("c", c, 9.0, pinned=True))
    registry.put(_entry("d", d, 1.0))
    assert plan_eviction(registry, need=10, budget=50, protected=[]) == []  # fits: nothing read
    assert plan_eviction(registry, need=20, budget=40, protected=[d]) == [b, a]
    registry.touch("b", 12.0)
    assert plan_eviction(registry, need=20, budget=40, protected=[]) == [d, a]
    registry.set_pinned("c", False)
    assert registry.sizes.order() == [d, a, c, b]
