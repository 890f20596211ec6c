"""One adapter as the worker knows it, across tiers: the adapter manager's record.

Only ``loading/`` reads or writes it; the rest of the worker holds adapter ids and asks the
manager (``tests/worker/test_adapter_state_owned.py`` checks).
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
