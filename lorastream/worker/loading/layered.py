"""Layer-ordered admission, the adapter manager's side (docs/design.md, "Layer-ordered
admission"): a slot for an adapter still landing, filled layer by layer as the fetch reports.

The manager calls both functions with its lock held. The order of events for one adapter:

1. its fetch starts; the first layers land (``AdapterEntry.layers_landed``);
2. a request waits for it and ``--layered-admission`` is on: :func:`landing_weights` maps the
   adapter's reserved host range (the bytes of layers not landed yet are not read), the device
   tier claims a slot and submits the landed layers' copies (``DeviceTier.claim_layers``);
3. each later report submits the next layers' copies (:func:`follow_landing`), and the end of
   the fetch all of them (layers the adapter leaves alone still need zeroing);
4. a failed fetch takes the partly filled slot back: it holds no adapter.

The copy of an adapter into a slot while its layers are still landing in host memory: one
load-stream job per layer, each submitted once its layer has landed, each with its own event
(docs/design.md, "Layer-ordered admission").

A :class:`LayeredCopy` is the entry's ``slot_event``: as an :class:`Event` it completes when the
last layer's copy did, so everything that asks whether the slot is ready (rule 1) sees a copy in
flight until then. :meth:`LayeredCopy.layers_ready` says how many leading layers a prefill may
read already. Example, 30 layers, 12 landed: jobs 0 (the slot's record) and 1..12 are submitted;
once the stream ran jobs 0..7, ``layers_ready()`` is 7 and ``query()`` False; after
``land(30)`` and every job, ``query()`` is True.

Rule 2 holds as for a whole copy: job 0 runs after the last step that read the slot, and the
stream runs jobs in submission order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from lorastream.worker.device.device import Device, Event, LoadStream
from lorastream.worker.loading.adapter import AdapterEntry, AdapterWeights, adapter_weights
from lorastream.worker.loading.host import HostAdapterBuffer, HostTier
from lorastream.worker.model.config import ModelConfig

if TYPE_CHECKING:  # the device tier makes the layered copies this module defines
    from lorastream.worker.loading.device_tier import DeviceTier


def landing_weights(entry: AdapterEntry, host: HostTier, device: Device, config: ModelConfig,
                    max_rank: int) -> AdapterWeights | None:
    """``entry``'s tensors as views of its reserved host range, while its fetch lands them;
    None when it has no range of the arena (nothing to map before the fetch ends). Raises
    InvalidAdapter when the manifest does not fit the base model (rule 6 needs only the
    manifest)."""
    storage = host.storage(entry)
    if storage is None:
        return None
    buffer = HostAdapterBuffer(device, storage)
    buffer.adopt(entry.manifest, 0.0)  # the layout only: the bytes are the fetch's to land
    return adapter_weights(buffer, config, max_rank)


def follow_landing(tier: DeviceTier, entry: AdapterEntry) -> None:
    """The fetch of ``entry`` reported progress, ended or failed: submit the copies of the
    layers that landed, or of all of them, or take the slot back."""
    copy = entry.slot_event
    if entry.slot is None or not isinstance(copy, LayeredCopy):
        return
    if entry.weights is not None:  # landed whole and checked
        copy.land(copy.num_layers)
    elif entry.fetching:
        copy.land(entry.layers_landed)
    else:  # the fetch failed: the slot holds part of an adapter that will not come
        tier.evict(entry)


Job = Sequence[Callable[[], None]]


class LayeredCopy(Event):
    def __init__(self, stream: LoadStream, jobs: Sequence[Job], after: Event | None) -> None:
        """``jobs``: the slot's record, then one job per layer (``SlotCopy.record``,
        ``SlotCopy.layers``); job 0 is submitted now, after ``after``."""
        assert len(jobs) >= 2, "a record job and at least one layer"
        self._stream = stream
        self._jobs = list(jobs)
        self._events: list[Event] = [stream.submit(self._jobs[0], after=after)]
        self._submitted = threading.Event()  # every layer's job is on the stream

    @property
    def num_layers(self) -> int:
        return len(self._jobs) - 1

    @property
    def layers_submitted(self) -> int:
        return len(self._events) - 1

    def land(self, layers: int) -> None:
        """Layers ``0 .. layers - 1`` are in host memory, verified: submit their copies (those
        not submitted yet, in order). Called under the adapter manager's lock."""
        for layer in range(self.layers_submitted, min(layers, self.num_layers)):
            self._events.append(self._stream.submit(self._jobs[1 + layer]))
        if self.layers_submitted == self.num_layers:
            self._submitted.set()

    def layers_ready(self) -> int:
        """Leading layers whose copy completed (never blocks); 0 until the record job ran.
        A job that failed ends the count (its layer is not ready, nor any after it)."""
        ready = 0
        for event in list(self._events):
            if not event.query() or getattr(event, "error", None) is not None:
                break
            ready += 1
        return max(0, ready - 1)

    @property
    def error(self) -> BaseException | None:
        """The error of the first job that failed, if one did (the manager fails the load)."""
        for event in list(self._events):
            error = getattr(event, "error", None)
            if error is not None:
                return error
        return None

    def query(self) -> bool:
        return self._submitted.is_set() and self._events[-1].query()

    def wait(self, timeout: float | None = None) -> bool:
        began = time.monotonic()
        if not self._submitted.wait(timeout):
            return False
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - began))
        return self._events[-1].wait(left)
