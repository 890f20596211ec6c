"""The host tier's memory: arena ranges (first fit, coalescing) and which host copies may be
evicted to make room. Engine-level behaviour (a fetch lands in its range) is in
test_overlap_loading.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lorastream.worker.device.device import Device, HostEvent
from lorastream.worker.loading.adapter import AdapterEntry
from lorastream.worker.loading.host import ALIGN, HostArena, HostTier
from lorastream.worker.metrics import WorkerMetrics

U = ALIGN  # one arena unit


@pytest.fixture
def device() -> Iterator[Device]:
    d = Device("cpu")
    yield d
    d.close()


def test_ranges_are_first_fit_aligned_and_coalesce_when_freed(device: Device) -> None:
    arena = HostArena(device, 8 * U + 100)  # the tail below one unit is not used
    assert arena.capacity == 8 * U
    a, b, c = arena.alloc(2 * U), arena.alloc(1), arena.alloc(3 * U - 7)
    assert (a, b, c) == (0, 2 * U, 3 * U)  # sizes round up to whole units
    assert arena.alloc(3 * U) is None and arena.largest_free == 2 * U
    arena.free(b)
    assert arena.alloc(2 * U) == 6 * U  # the 1-unit hole is skipped
    arena.free(a)  # merges with the hole left by b
    assert arena.largest_free == 3 * U
    assert arena.alloc(3 * U) == 0
    arena.free(0), arena.free(c), arena.free(6 * U)
    assert arena.free_bytes == arena.largest_free == 8 * U  # one range again


def test_a_view_is_the_arenas_memory(device: Device) -> None:
    arena = HostArena(device, 4 * U)
    offset = arena.alloc(U)
    assert offset is not None
    arena.view(offset, 10).fill_(7)
    assert arena.buffer[offset : offset + 10].tolist() == [7] * 10
    with pytest.raises(AssertionError):
        arena.view(offset + U, 10)  # not allocated


def _entry(name: str, units: int, last_used: float, **state: object) -> AdapterEntry:
    entry = AdapterEntry(name, name, manifest=None, last_used=last_used)  # type: ignore[arg-type]  # no manifest needed by the tier
    entry.weights = object()  # type: ignore[assignment]  # a host copy is present
    entry.host_bytes = units * U
    for key, value in state.items():
        setattr(entry, key, value)
    return entry


def _hold(tier: HostTier, entry: AdapterEntry) -> None:
    """Put ``entry`` in the arena as if it had been fetched."""
    entry.host_offset = tier.arena.alloc(entry.host_bytes)
    assert entry.host_offset is not None


def test_room_is_made_by_evicting_idle_copies_least_recently_used_first(device: Device) -> None:
    tier = HostTier(device, 3 * U, WorkerMetrics())
    old, new, held = _entry("old", 1, 1.0), _entry("new", 1, 2.0), _entry("held", 1, 0.5, refs=1)
    for e in (old, new, held):
        _hold(tier, e)
    incoming = AdapterEntry("in", "in", manifest=None)  # type: ignore[arg-type]  # no manifest needed by the tier
    assert tier.reserve([old, new, held], incoming, U)
    assert old.weights is None and old.host_bytes == 0 and old.host_offset is None
    assert new.weights is not None and held.weights is not None
    assert incoming.host_offset == 0 and incoming.host_bytes == U  # old's range, reused


@pytest.mark.parametrize(
    "state",
    [
        {"refs": 1},  # a queued or running request needs it
        {"pinned": True},
        {"slot_event": HostEvent(done=False)},  # its copy into a slot still reads the range
    ],
    ids=["referenced", "pinned", "copy-in-flight"],
)
def test_adapters_in_use_are_never_evicted(device: Device, state: dict[str, object]) -> None:
    tier = HostTier(device, 2 * U, WorkerMetrics())
    busy = _entry("busy", 2, 0.0, **state)
    _hold(tier, busy)
    incoming = AdapterEntry("in", "in", manifest=None)  # type: ignore[arg-type]  # no manifest needed by the tier
    assert not tier.reserve([busy], incoming, U)
    assert busy.weights is not None and incoming.host_bytes == 0
    if "slot_event" in state:  # once the copy landed, the range may be reused
        busy.slot_event.set()  # type: ignore[union-attr]  # slot_event: not None in this state
        assert tier.reserve([busy], incoming, U) and busy.weights is None


def test_a_fragmented_arena_falls_back_to_a_separate_allocation(device: Device) -> None:
    tier = HostTier(device, 4 * U, WorkerMetrics())
    a, b, c = _entry("a", 1, 0.0, refs=1), _entry("b", 1, 0.0), _entry("c", 1, 0.0, refs=1)
    for e in (a, b, c):
        _hold(tier, e)  # a b c _ : after evicting b, the free units are not adjacent
    incoming = AdapterEntry("in", "in", manifest=None)  # type: ignore[arg-type]  # no manifest needed by the tier
    assert tier.reserve([a, b, c], incoming, 2 * U)
    assert b.weights is None  # evicted for the bytes
    assert incoming.host_bytes == 2 * U and incoming.host_offset is None
    assert tier.storage(incoming) is None  # the fetch allocates its own buffer


def test_drop_returns_the_range(device: Device) -> None:
    tier = HostTier(device, 2 * U, WorkerMetrics())
    entry = _entry("e", 2, 0.0)
    _hold(tier, entry)
    assert tier.arena.free_bytes == 0
    tier.drop(entry)
    assert tier.arena.free_bytes == 2 * U and entry.host_offset is None
