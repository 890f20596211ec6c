"""One adapter as the worker knows it, across tiers: the adapter manager's record.

Only ``loading/`` reads it, and only its own methods write its fields (the manager and the tiers
call them, under the manager's lock); the rest of the worker holds adapter ids and asks the
manager (``tests/worker/loading/test_adapter_state_owned.py`` checks both).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from lorastream.core.errors import LorastreamError
from lorastream.core.manifest import AdapterManifest
from lorastream.worker.device.device import Event
from lorastream.worker.loading.adapter_weights import AdapterWeights


class Residency(Enum):
    REMOTE = "remote"  # known, tensors only in the store
    LOADING = "loading"  # being fetched to host or copied to a slot
    HOST = "host"
    DEVICE = "device"


@dataclass
class AdapterEntry:
    adapter_id: str
    name: str
    manifest: AdapterManifest
    local_path: Path | None = None
    weights: AdapterWeights | None = None  # host tier
    host_bytes: int = 0  # reserved against the host budget (set when the fetch begins)
    host_offset: int | None = None  # its range in the host arena; None: allocated on its own
    fetching: bool = False
    # Leading layers landed in host memory, verified, per the manifest's own layer count
    # (layer_progress.manifest_layers): grows while the fetch runs, that count once the weights
    # are set, 0 when a fetch starts or fails.
    layers_landed: int = 0
    error: LorastreamError | None = None
    slot: int | None = None
    slot_event: Event | None = None  # completion of the copy into ``slot``
    refs: int = 0
    pinned: bool = False
    last_used: float = field(default_factory=time.monotonic)
    fetch_started: float = 0.0  # perf_counter when the store fetch began
    copy_started: float = 0.0  # perf_counter when the copy into ``slot`` was submitted

    @property
    def residency(self) -> Residency:
        if self.slot is not None:
            event = self.slot_event
            return Residency.DEVICE if event is None or event.query() else Residency.LOADING
        if self.fetching:
            return Residency.LOADING
        return Residency.HOST if self.weights is not None else Residency.REMOTE

    @property
    def copying(self) -> bool:
        """A copy from its host buffer into a slot is still in flight."""
        return self.slot_event is not None and not self.slot_event.query()

    # -- the only writers of its fields (tests/worker/loading/test_adapter_state_owned.py checks) --
    def acquire(self) -> None:
        """A queued request (or an operator's load) needs it; a new one retries a failed load."""
        if self.refs == 0:
            self.error = None
        self.refs += 1
        self.last_used = time.monotonic()

    def release(self) -> None:
        self.refs -= 1
        assert self.refs >= 0, f"reference count of {self.name} went negative"
        self.last_used = time.monotonic()

    def pin(self) -> None:
        self.pinned = True

    def unpin(self) -> None:
        self.pinned = False

    def rename(self, name: str) -> None:
        """Fetch it by ``name`` from now on (the name it was known by was unloaded)."""
        self.name = name

    def register_local(self, path: Path, pin: bool) -> None:
        """Registered from a local directory: never fetched from the store."""
        self.local_path = path
        self.pinned = self.pinned or pin

    def fail(self, error: LorastreamError) -> None:
        self.error = error

    def reserve_host(self, nbytes: int, offset: int | None) -> None:
        """``nbytes`` of the host budget are its, at ``offset`` of the arena (None: its own)."""
        self.host_bytes, self.host_offset = nbytes, offset

    def drop_host(self) -> None:
        """Its host copy (or reservation) is gone."""
        self.weights, self.host_bytes, self.host_offset = None, 0, None
        self.layers_landed = 0

    def begin_fetch(self) -> None:
        self.fetching = True
        self.layers_landed = 0
        self.fetch_started = time.perf_counter()

    def land_layers(self, count: int) -> bool:
        """The fetch reports ``count`` leading layers landed, verified; True when that is news."""
        if not self.fetching or count <= self.layers_landed:
            return False
        self.layers_landed = count
        return True

    def land(self, weights: AdapterWeights, layers: int) -> None:
        """Its checked host copy (``layers``: the manifest's layer count)."""
        self.weights = weights
        self.layers_landed = layers

    def end_fetch(self) -> None:
        self.fetching = False

    def take_slot(self, slot: int) -> None:
        """``slot`` is its; the copy into it is submitted next (:meth:`copy_submitted`)."""
        self.slot = slot
        self.copy_started = time.perf_counter()

    def copy_submitted(self, event: Event) -> None:
        self.slot_event = event

    def leave_slot(self) -> None:
        self.slot, self.slot_event = None, None
