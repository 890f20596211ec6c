"""The copy of an adapter into a slot while its layers are still landing in host memory: one
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

from lorastream.worker.device.device import Event, LoadStream

Job = Sequence[Callable[[], None]]


class LayeredCopy(Event):
    def __init__(self, stream: LoadStream, jobs: Sequence[Job], after: Event | None) -> None:
        """``jobs``: the slot's record, then one job per layer (``LoraSlots.layer_write_ops``);
        job 0 is submitted now, after ``after``."""
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
