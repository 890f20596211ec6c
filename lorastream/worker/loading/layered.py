"""Layer-ordered admission, the adapter manager's side (``--layered-admission``, off by default;
docs/design.md, "Layer-ordered admission"): a slot for an adapter still landing, filled layer by
layer as the fetch reports. The manager holds a :class:`LayeredSlots` only with the setting on,
and calls it with its lock held; without it nothing here runs.

The order of events for one adapter:

1. its fetch starts; the first layers land (``AdapterEntry.layers_landed``);
2. a request waits for it: :func:`landing_weights` maps the adapter's reserved host range (the
   bytes of layers not landed yet are not read), :meth:`LayeredSlots.claim` takes a slot and
   submits the landed layers' copies;
3. each later report submits the next layers' copies (:meth:`LayeredSlots.follow`), and the end
   of the fetch all of them (layers the adapter leaves alone still need zeroing);
4. a failed fetch takes the partly filled slot back: it holds no adapter.

The copy (:class:`LayeredCopy`) runs the slot's copy plan (``SlotCopy``) layer by layer: one
load-stream job for the record, then one per layer, each submitted once its layer has landed,
each with its own event. It is the entry's ``slot_event``: as an :class:`Event` it completes when
the last layer's copy did, so everything that asks whether the slot is ready (rule 1) sees a copy
in flight until then. :meth:`LayeredCopy.layers_ready` says how many leading layers a prefill may
read already. Example, 30 layers, 12 landed: the record job and layers 0..11 are submitted;
once the stream ran the record and layers 0..6, ``layers_ready()`` is 7 and ``query()`` False;
after ``land(30)`` and every job, ``query()`` is True.

Rule 2 holds as for a whole copy: the record job runs after the last step that read the slot,
and the stream runs jobs in submission order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from lorastream.worker.device.device import Device, Event, LoadStream
from lorastream.worker.loading.adapter import AdapterEntry, AdapterWeights, adapter_weights
from lorastream.worker.loading.device_tier import DeviceTier
from lorastream.worker.loading.host import HostAdapterBuffer, HostTier
from lorastream.worker.lora.slots import SlotCopy
from lorastream.worker.lora.vocab import VocabBudget
from lorastream.worker.model.config import ModelConfig


def landing_weights(entry: AdapterEntry, host: HostTier, device: Device, config: ModelConfig,
                    max_rank: int, vocab_budget: VocabBudget | None = None
                    ) -> AdapterWeights | None:
    """``entry``'s tensors as views of its reserved host range, while its fetch lands them;
    None when it has no range of the arena (nothing to map before the fetch ends). Raises
    InvalidAdapter when the manifest does not fit the base model (rule 6 needs only the
    manifest)."""
    storage = host.storage(entry)
    if storage is None:
        return None
    buffer = HostAdapterBuffer(device, storage)
    buffer.adopt(entry.manifest, 0.0)  # the layout only: the bytes are the fetch's to land
    return adapter_weights(buffer, config, max_rank, vocab_budget)


class LayeredCopy(Event):
    def __init__(self, stream: LoadStream, plan: SlotCopy, after: Event | None) -> None:
        """The record job of ``plan`` is submitted now, after ``after``; each layer's job
        (``plan.layers(l, l + 1)``) once :meth:`land` says its layer landed."""
        self._stream = stream
        self._plan = plan
        self._events: list[Event] = [stream.submit([plan.record], after=after)]
        self._submitted = threading.Event()  # every layer's job is on the stream

    @property
    def num_layers(self) -> int:
        return self._plan.num_layers

    @property
    def layers_submitted(self) -> int:
        return len(self._events) - 1

    def land(self, layers: int) -> None:
        """Layers ``0 .. layers - 1`` are in host memory, verified: submit their copies (those
        not submitted yet, in order). Called under the adapter manager's lock."""
        for layer in range(self.layers_submitted, min(layers, self.num_layers)):
            self._events.append(self._stream.submit(self._plan.layers(layer, layer + 1)))
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


class LayeredSlots:
    def __init__(self, tier: DeviceTier) -> None:
        """Slots filled layer by layer in ``tier``; every call with the manager's lock held."""
        self.tier = tier

    def claim(self, entries: Iterable[AdapterEntry], entry: AdapterEntry,
              weights: AdapterWeights, landed: int) -> bool:
        """``DeviceTier.claim`` for an adapter whose layers are still landing (``landed`` of them
        so far): the copy goes layer by layer (:class:`LayeredCopy`), each layer's once it landed
        (:meth:`land`). ``weights`` maps the host buffer, landed or not: only the copies of
        landed layers read it. Not timed for the cost model: a layered copy's span includes the
        wait for its bytes."""
        taken = self.tier.take_slot(entries, entry)
        if taken is None:
            return False
        slot, last_read = taken
        plan = self.tier.slots.copy_plan(
            slot, weights.adapter_id, weights.rank, weights.scaling, list(weights.blocks),
            folds=weights.folds,
        )
        copy = LayeredCopy(self.tier.device.load_stream, plan, after=last_read)
        copy.land(landed)
        entry.copy_submitted(copy)
        return True

    @staticmethod
    def land(entry: AdapterEntry, landed: int) -> None:
        """Layers ``0 .. landed - 1`` of ``entry`` are in host memory: copy those not yet on
        their way (a no-op unless its copy is a :class:`LayeredCopy`)."""
        if isinstance(entry.slot_event, LayeredCopy):
            entry.slot_event.land(landed)

    def follow(self, entry: AdapterEntry) -> None:
        """The fetch of ``entry`` reported progress, ended or failed: submit the copies of the
        layers that landed, or of all of them, or take the slot back."""
        if entry.slot is None or not isinstance(entry.slot_event, LayeredCopy):
            return
        if entry.weights is not None:  # landed whole and checked
            self.land(entry, self.tier.slots.num_layers)
        elif entry.fetching:
            self.land(entry, entry.layers_landed)
        else:  # the fetch failed: the slot holds part of an adapter that will not come
            self.tier.evict(entry)

    def layers_ready(self, entry: AdapterEntry) -> int:
        """Leading layers of ``entry`` in its slot (never blocks): all of them once
        ``DeviceTier.ready``, some while a layered copy runs, else 0."""
        if self.tier.ready(entry):
            return self.tier.slots.num_layers
        if entry.slot is not None and isinstance(entry.slot_event, LayeredCopy):
            return entry.slot_event.layers_ready()
        return 0
