"""What the adapter manager tells the rest of the worker about its adapters, as plain values.

Nothing outside ``loading/`` holds an :class:`AdapterEntry`: the operator calls get an
:class:`AdapterStatus` per name, the stats and the metrics a :class:`TierUsage`, and tests an
:class:`AdapterSnapshot` of one adapter's internals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from lorastream.core.generation import AdapterStatus
from lorastream.worker.loading.entry import AdapterEntry, Residency


@dataclass(frozen=True)
class TierUsage:
    """The host and device tiers at one moment."""

    resident: dict[str, int]  # tier ("host", "device") -> adapters
    resident_bytes: dict[str, int]  # tier -> bytes
    loading: int  # adapters being fetched into host memory or copied into a slot
    slots_used: int  # slots holding (or being loaded with) an adapter
    host_bytes_used: int  # reserved against the host budget
    host_bytes_budget: int
    references: int  # queued and running requests (and operator loads) holding adapters


@dataclass(frozen=True)
class AdapterSnapshot:
    """One adapter's state inside the manager (for tests and debugging)."""

    name: str
    adapter_id: str
    residency: str  # "remote" | "loading" | "host" | "device"
    references: int
    slot: int | None
    fetching: bool
    on_host: bool  # its checked host copy is present
    host_offset: int | None  # its range in the host arena; None: none, or allocated on its own
    host_bytes: int
    error: str | None
    block_addresses: tuple[int, ...]  # data pointers of its host blocks


def adapter_status(name: str, entry: AdapterEntry) -> AdapterStatus:
    return AdapterStatus(
        name=name,
        adapter_id=entry.adapter_id,
        residency=entry.residency.value,
        rank=entry.manifest.rank,
        nbytes=entry.manifest.total_bytes,
        pinned=entry.pinned,
        references=entry.refs,
        slot=-1 if entry.slot is None else entry.slot,
    )


def adapter_statuses(
    entries: Iterable[AdapterEntry], names_of: Callable[[str], list[str]]
) -> list[AdapterStatus]:
    """One status per name (``names_of(adapter_id)``: its names, sorted), ordered by the
    adapters' names; an adapter no name maps to any more is listed under its own."""
    statuses: list[AdapterStatus] = []
    for entry in sorted(entries, key=lambda e: e.name):
        own = names_of(entry.adapter_id)
        statuses.extend(adapter_status(n, entry) for n in own or [entry.name])
    return statuses


def snapshot(entry: AdapterEntry) -> AdapterSnapshot:
    weights = entry.weights
    return AdapterSnapshot(
        name=entry.name,
        adapter_id=entry.adapter_id,
        residency=entry.residency.value,
        references=entry.refs,
        slot=entry.slot,
        fetching=entry.fetching,
        on_host=weights is not None,
        host_offset=entry.host_offset,
        host_bytes=entry.host_bytes,
        error=None if entry.error is None else str(entry.error),
        block_addresses=(
            () if weights is None else tuple(block.data_ptr() for *_, block in weights.blocks)
        ),
    )


def tier_usage(entries: Iterable[AdapterEntry], host_budget: int) -> TierUsage:
    entries = list(entries)
    on_host = [e for e in entries if e.weights is not None]
    residencies = [e.residency for e in entries]
    on_device = [e for e, r in zip(entries, residencies, strict=True) if r is Residency.DEVICE]
    return TierUsage(
        resident={"host": len(on_host), "device": len(on_device)},
        resident_bytes={"host": sum(e.host_bytes for e in on_host),
                        "device": sum(e.manifest.total_bytes for e in on_device)},
        loading=sum(1 for r in residencies if r is Residency.LOADING),
        slots_used=sum(1 for e in entries if e.slot is not None),
        host_bytes_used=sum(e.host_bytes for e in entries),
        host_bytes_budget=host_budget,
        references=sum(e.refs for e in entries),
    )
