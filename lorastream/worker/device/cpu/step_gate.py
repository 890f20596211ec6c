"""On the CPU, copies into the LoRA slots take turns with the decode steps instead of running
beside them.

On a GPU the load stream's copies are DMA: the compute stream does not notice them. On the CPU a
copy is a memcpy on a core, and a memcpy beside a decode step slows the step far more than it
costs on its own: the step runs its ops on two OpenMP threads that wait for each other at the end
of every op, so whatever the copy takes from either core (time slices, memory bandwidth, cache)
stalls both: traced beside decoding streams, a copy took several times longer than alone and
the steps it overlapped ran markedly slower, which set the running streams' ITL p99
(docs/notes/loading.md, "Copies take turns with the steps on the CPU").

So the CPU load stream copies only between steps. The engine runs each step inside
:meth:`StepGate.step` and calls :meth:`StepGate.give_turn` before it schedules the next one; the
copy thread runs its copy operations inside turns (:meth:`StepGate.begin_turn` /
:meth:`StepGate.end_turn`):

* a step never starts while a turn is in progress, and a turn never starts while a step is;
* between two steps the copy thread gets at most one turn, and ends it once it has copied for
  ``turn_s`` (one operation past the budget at most: operations are a few layers, ~1 MB): a load
  adds at most ``turn_s`` to the gap before each step, until it is done;
* the turn comes before the engine schedules: a copy that becomes ready during a step lands in
  the gap after it, and the request waiting for it joins the next step (as early as a copy that
  ran beside the step could have made it);
* when the engine has not stepped for ``idle_s`` (it has nothing to run, or it waits for the load
  itself, as without overlapped loading), turns follow each other without waiting;
* ``turn_s == 0`` turns the gate off: copies run beside the steps (the earlier behaviour).

On CUDA the gate is off (:class:`~lorastream.worker.device.device.Device` gives it ``turn_s == 0``).

Fetches get turns too (:meth:`StepGate.hold_gap`), if asked for. A store fetch runs in the
fetch process at SCHED_IDLE (``loading/fetch.py``), so it only gets the CPU time that
decoding leaves, and an engine that steps back to back leaves almost none: with streams
decoding on every core, a cold adapter took several times its link time to land, though the
fetch and the store need little CPU for it. So while a fetch is in flight and sequences run, the
engine can hold each gap open for ``fetch_turn_s`` before it schedules: the idle-priority
loaders get both cores for that long, and between the steps, where they stall no OpenMP
barrier, and the loads land sooner (docs/notes/loading.md, "Fetch turns"). It is the engine,
not the fetch, that yields: a fetch's CPU is gRPC's threads and socket reads, which no gate can
split into turns as it splits a memcpy. The running streams pay
for it (the turn, on every step while a fetch is in flight), so it is off by default
(``fetch_turn_s == 0``): a choice for CPU deployments that value a cold adapter's first token
over the running streams' inter-token latency. Always off on CUDA, whose loaders run on host
cores the GPU's compute does not use.

A share of the cores for a cold request (:meth:`StepGate.hold_share`, ``--load-share``). A
fixed turn per gap is blind to what waits on the fetch. The signal that loading is behind is a
request waiting for its adapter while its fetch (or, before it, the store's answer with the
adapter's manifest) is in flight: then, and only then, the engine
holds each gap for ``share / (1 - share)`` of the step before it, so that of the wall time the
loaders get ``share`` (at most :data:`MAX_HOLD_S` per gap) and decoding the rest. The gate keeps
the ledger (:attr:`StepGate.held_s` against :attr:`StepGate.stepped_s`) that the tests check.
Example, share 0.3 (the default): 0.3 / 0.7, about 0.43 of each step's duration, held before the
next step while a cold request waits (the running streams' steps that much further apart
meanwhile), none once the adapter is in its slot.

A hold gives way to an arrival that needs no load (``defer``): when requests whose adapters are
already on the device arrived since the last step, the gap is not held, so their prefill is not
delayed by another request's load, and the hold it skipped is owed to the next gap (added to
that gap's own, within :data:`MAX_HOLD_S`). Never two gaps in a row: a steady stream of arrivals
cannot starve the loaders again. Over the wait the loaders keep their share.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

IDLE_S = 0.002  # no step for this long: the engine is idle, turns need not wait for a gap
RECORD = 4096  # steps and holds remembered
MAX_HOLD_S = 0.05  # the longest gap held for a load's share (a very long step does not make a
# longer stall)


class StepGate:
    """Steps and copy turns, never at once; one turn in each gap between steps."""

    def __init__(self, turn_s: float, idle_s: float = IDLE_S) -> None:
        self.turn_s = turn_s
        self.idle_s = idle_s
        self._cond = threading.Condition()
        self._stepping = False
        self._in_turn = False
        self._step_waiting = False  # the engine waits to start a step
        self._turn_waiting = False  # the copy thread waits to start a turn
        self._gap = 0  # counts the steps ended: the gap after step n is gap n
        self._turn_gap = -1  # the gap of the last turn
        self._last_step_end = -float("inf")
        self.turns = 0  # turns taken so far (tests and logs)
        self.holds = 0  # gaps held open for fetches so far (tests and logs)
        self.last_step_s = 0.0  # how long the last step ran
        self.stepped_s = 0.0  # the ledger: seconds in steps, and in gaps held open (tests, logs)
        self.held_s = 0.0
        self.owed_s = 0.0  # a hold deferred for an arrival, owed to the next gap (> 0: the
        # last gap's hold was deferred)
        # the last steps, held gaps and deferred holds, in order: ("step" | "hold" | "defer",
        # seconds; 0 for a deferral) (tests, logs)
        self.record: deque[tuple[str, float]] = deque(maxlen=RECORD)

    @property
    def enabled(self) -> bool:
        return self.turn_s > 0

    def give_turn(self) -> None:
        """Let a copy thread that waits for this gap have its turn now, and wait for its end.

        The engine calls this before it schedules the next step: a copy that became ready
        during the last step then lands in this gap, and its request joins the very next step.
        """
        if not self.enabled:
            return
        with self._cond:
            self._wait_for_turns()

    def hold_gap(self, seconds: float) -> None:
        """Keep the engine off the cores for ``seconds`` before the next step (a fetch turn,
        see the module's docstring): loaders at idle priority run meanwhile, and a copy thread
        waiting for this gap may take its turn in it (still one turn per gap)."""
        began = time.monotonic()
        deadline = began + seconds
        with self._cond:
            self._step_waiting = True  # what a copy thread sees: a gap the engine waits in
            self._cond.notify_all()
            while (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            self._step_waiting = False
            self._cond.notify_all()  # a copy thread that waits for the engine's wait to end
            self.holds += 1
            held = time.monotonic() - began
            self.held_s += held
            self.record.append(("hold", held))

    def hold_share(self, share: float, defer: bool = False) -> None:
        """Hold this gap for ``share / (1 - share)`` of the last step, plus what a deferred
        hold owes (at most :data:`MAX_HOLD_S`): over steps and held gaps, loaders get
        ``share`` of the wall time. ``defer``: requests that need no load arrived: hold
        nothing now and owe it to the next gap, unless the last gap's hold was deferred too."""
        if not (0 < share < 1 and self.last_step_s > 0):
            return
        seconds = min(share / (1 - share) * self.last_step_s + self.owed_s, MAX_HOLD_S)
        if defer and not self.owed_s:
            self.owed_s = seconds
            self.record.append(("defer", 0.0))
            return
        self.owed_s = 0.0
        self.hold_gap(seconds)

    def forgive(self) -> None:
        """Nothing waits for a load any more: a deferred hold is owed no longer."""
        self.owed_s = 0.0

    @contextmanager
    def step(self) -> Iterator[None]:
        """Run one step: waits for a turn in progress, and first lets a waiting copy thread
        have its turn in this gap (if :meth:`give_turn` did not already)."""
        if not self.enabled:
            began = time.monotonic()
            try:
                yield
            finally:
                self._stepped(began)
            return
        with self._cond:
            self._wait_for_turns()
            self._stepping = True
        began = time.monotonic()
        try:
            yield
        finally:
            with self._cond:
                self._stepped(began)
                self._stepping = False
                self._gap += 1
                self._last_step_end = time.monotonic()
                self._cond.notify_all()

    def _stepped(self, began: float) -> None:
        self.last_step_s = time.monotonic() - began
        self.stepped_s += self.last_step_s
        self.record.append(("step", self.last_step_s))

    def _wait_for_turns(self) -> None:
        """(lock held) Until no turn is in progress and a waiting copy thread had this gap's."""
        self._step_waiting = True
        while self._in_turn or (self._turn_waiting and self._turn_gap != self._gap):
            self._cond.wait()
        self._step_waiting = False
        if self._turn_waiting:  # a copy thread held back by the waiting engine looks again
            self._cond.notify_all()

    def begin_turn(self) -> None:
        """Block until the copy thread may copy: between steps, once per gap (or the engine is
        idle). Pair with :meth:`end_turn`."""
        if not self.enabled:
            return
        with self._cond:
            self._turn_waiting = True
            self._cond.notify_all()  # a step about to start lets this turn go first
            while not self._may_turn():
                if self._stepping or self._step_waiting:
                    self._cond.wait()  # until the step, or the engine's wait, ends
                else:  # our turn of this gap was taken: wait for a step, or for the engine idle
                    self._cond.wait(self._last_step_end + self.idle_s - time.monotonic())
            self._turn_waiting = False
            self._in_turn = True
            self._turn_gap = self._gap
            self.turns += 1

    def end_turn(self) -> None:
        if not self.enabled:
            return
        with self._cond:
            self._in_turn = False
            self._cond.notify_all()

    def _may_turn(self) -> bool:
        if self._stepping or (self._step_waiting and self._turn_gap == self._gap):
            return False
        idle = time.monotonic() - self._last_step_end >= self.idle_s
        return self._turn_gap != self._gap or idle


class CopyTurn:
    """The copy thread's turns of the step gate (:class:`StepGate`): one begins before an
    operation when none is open, and one that has copied for ``turn_s`` ends before the next
    operation, whichever job that belongs to; so consecutive small jobs (an adapter copied layer
    by layer as its layers land) share a turn instead of taking one gap between steps each."""

    def __init__(self, gate: StepGate) -> None:
        self.gate = gate
        self._began: float | None = None

    @property
    def open(self) -> bool:
        return self._began is not None

    def before_op(self) -> None:
        if self._began is not None and time.perf_counter() - self._began >= self.gate.turn_s:
            self.end()
        if self._began is None:
            self.gate.begin_turn()
            self._began = time.perf_counter()

    def end(self) -> None:
        if self._began is not None:
            self.gate.end_turn()
            self._began = None
