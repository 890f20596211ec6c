"""The device tier: which adapter sits in which slot, the copies into slots, and what a step
needs from them.

The rules of docs/design.md kept here:
1. a slot is usable only once its copy completed: :meth:`DeviceTier.ready` asks the copy's event
   without blocking, and :meth:`DeviceTier.step` hands the step the events its compute stream
   must wait on;
2. a slot is overwritten only after the last step that read it: the copy is submitted to the load
   stream ``after`` that step's compute event (:meth:`DeviceTier.mark_read` records it);
4. only an unpinned adapter at zero references is evicted from its slot (LRU).

Two things limit what the slots hold: their count, and the device bytes of the adapters'
vocabulary modules (``LoraSlots.vocab_budget``, ``lora/vocab.py``): a saved ``embed_tokens`` or
``lm_head`` is a whole ``[V, H]`` matrix. An adapter with such parts takes a slot only when both
have room, made by evicting idle adapters, least recently used first (those with vocabulary
parts, for bytes). An adapter whose parts exceed the whole budget was refused before any of
this (``check_fits``).

The adapter manager calls every method here with its lock held.

When to hold new prefills for a load about to land (docs/design.md, "Scheduling around loads").

Admitting a ready request now and the loading one later costs two prefill steps; waiting for the
load and prefilling both together costs one step plus the wait. With a step costing
``fixed + per_token * tokens`` (fitted from the steps the engine ran), holding saves ``fixed``
and costs the ready requests up to ``eta`` of extra latency. So new prefills are held when

    eta(load) < fixed          (the wait is cheaper than the extra step it avoids)

and never for longer than ``max_hold_s``; running sequences keep decoding meanwhile (a held
step is a decode-only step). ``eta`` is the load's expected remaining time from the fetch and
copy rates observed so far. Example: steps of 40 ms fixed + 0.5 ms/token; a host -> device copy
expected to end in 3 ms -> hold; a store fetch expected to take 300 ms -> admit now.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from lorastream.worker.device.device import COMPLETED, Device, Event
from lorastream.worker.loading.adapter import AdapterEntry, AdapterWeights
from lorastream.worker.loading.load_timeline import LoadTimeline
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepAdapters:
    """What one step needs from the adapters (:meth:`AdapterManager.prepare_step`).

    Example: sequences for adapters ``a`` (slot 2, copy landed two steps ago), none, ``b``
    (slot 0, copied since the last step) give ``slots [2, -1, 0]``, ``load_events`` the events of
    both copies and ``read {0, 2}``.
    """

    slots: list[int]  # per sequence of the step, in order: its slot, -1 for the base model
    load_events: list[Event]  # rule 1: the compute stream waits on these before the step
    read: frozenset[int]  # the slots the step reads (rule 2: recorded with its compute event)


class DeviceTier:
    def __init__(self, slots: LoraSlots, device: Device, metrics: WorkerMetrics,
                 cost_model: AdmissionCostModel) -> None:
        self.slots = slots
        self.device = device
        self.metrics = metrics
        self.cost_model = cost_model
        self._slot_read: list[Event] = [COMPLETED] * slots.num_slots  # rule 2
        self._held: set[int] = set()  # slots a step reads, its read not recorded yet (hold)

    @staticmethod
    def ready(entry: AdapterEntry) -> bool:
        """True when ``entry`` sits in a slot whose copy completed (never blocks)."""
        return entry.slot is not None and (entry.slot_event is None or entry.slot_event.query())

    def claim(self, entries: Iterable[AdapterEntry], entry: AdapterEntry,
              weights: AdapterWeights) -> bool:
        """Take a free slot, or the least recently used idle one, for ``entry`` and submit the
        copy of ``weights`` into it on the load stream, after the last step that read the slot.
        False when every slot holds an adapter in use or pinned."""
        taken = self.take_slot(entries, entry)
        if taken is None:
            return False
        slot, last_read = taken
        if entry.load is not None:
            entry.load.copy_submitted = entry.copy_started
        entry.copy_submitted(
            self.device.load_stream.submit(self._copy_ops(slot, weights, entry.load),
                                           after=last_read)
        )
        return True

    def evict(self, entry: AdapterEntry) -> None:
        if entry.slot is not None:
            self.slots.clear(entry.slot)
        entry.leave_slot()

    def step(self, entries: Sequence[AdapterEntry | None]) -> StepAdapters:
        """The slots of a step's sequences (``entries``, None for the base model) and the copies
        the step must wait for."""
        slots: list[int] = []
        load_events: dict[int, Event] = {}
        for entry in entries:
            if entry is None:
                slots.append(-1)
                continue
            if entry.slot is None:  # referenced adapters are never evicted: this is a bug
                raise RuntimeError(f"{entry.name} was scheduled for a step but has no slot")
            slots.append(entry.slot)
            if entry.slot_event is not None:
                load_events[entry.slot] = entry.slot_event
        return StepAdapters(slots, list(load_events.values()), frozenset(load_events))

    def mark_read(self, slot_ids: Iterable[int], event: Event) -> None:
        """Record that the step behind ``event`` read ``slot_ids`` (rule 2)."""
        for slot in slot_ids:
            self._slot_read[slot] = event

    def hold(self, slot_ids: Iterable[int]) -> None:
        """A step is about to read ``slot_ids`` and its read is not recorded yet: hand them to
        no other adapter meanwhile, even if their own is evicted (:meth:`release` ends it)."""
        self._held.update(slot for slot in slot_ids if slot >= 0)

    def release(self, slot_ids: Iterable[int], event: Event) -> None:
        """The step behind ``event`` read ``slot_ids`` (rule 2); they may be taken again."""
        read = [slot for slot in slot_ids if slot >= 0]
        self.mark_read(read, event)
        self._held.difference_update(read)

    def eta(self, entry: AdapterEntry, now: float) -> float | None:
        """Expected seconds until ``entry`` is usable in a slot; None when no load is under way
        (the cost model's estimate)."""
        nbytes = entry.manifest.total_bytes
        if entry.fetching:
            return self.cost_model.eta(nbytes, entry.fetch_started, True, now)
        if entry.slot is not None and entry.slot_event is not None:
            if entry.slot_event.query():
                return 0.0
            return self.cost_model.eta(nbytes, entry.copy_started, False, now)
        return None

    def _copy_ops(self, slot: int, weights: AdapterWeights,
                  timeline: LoadTimeline | None = None) -> list[Callable[[], None]]:
        """The load-stream job: zero ``slot`` and copy the adapter in, timed from its first
        operation to its last (on the CPU that includes the steps between its turns); the copy
        thread's CPU over it goes to ``timeline``."""
        started = cpu = 0.0

        def start() -> None:
            nonlocal started, cpu
            started, cpu = time.perf_counter(), time.thread_time()
            if timeline is not None:
                timeline.copy_began = started

        def observe() -> None:
            ended = time.perf_counter()
            elapsed = ended - started
            if timeline is not None:
                timeline.copy_cpu_s = time.thread_time() - cpu
                timeline.copy_ended = ended
            self.metrics.device_copy_seconds.observe(elapsed)
            self.cost_model.observe_copy(weights.nbytes, elapsed)

        ops = self.slots.write_ops(
            slot, weights.adapter_id, weights.rank, weights.scaling, list(weights.blocks),
            folds=weights.folds,
        )
        return [start, *ops, observe]

    def take_slot(self, entries: Iterable[AdapterEntry],
                  entry: AdapterEntry) -> tuple[int, Event] | None:
        """:meth:`_free_slot`, recorded as ``entry``'s (its copy not submitted yet), and the
        event of the last step that read it: the copy goes on the load stream after that (rule
        2). None when every slot holds an adapter in use or pinned."""
        slot = self._free_slot(entries, self.slots.vocab_budget.need(entry.manifest))
        if slot is None:
            return None
        entry.take_slot(slot)
        self.slots.claim(slot, entry.adapter_id)
        return slot, self._slot_read[slot]

    def claimable(self, entries: Iterable[AdapterEntry]) -> int:
        """How many slots claims could take now: empty ones and those of idle unpinned
        adapters (what :meth:`_free_slot` hands out)."""
        occupants = {e.slot: e for e in entries if e.slot is not None}
        empty = sum(1 for slot in range(self.slots.num_slots)
                    if slot not in occupants and slot not in self._held)
        return empty + sum(1 for e in occupants.values() if e.refs == 0 and not e.pinned)

    def vocab_used(self, entries: Iterable[AdapterEntry]) -> int:
        """Device bytes the vocabulary modules of the adapters in slots take (or will, once
        their copies ran)."""
        return sum(self.slots.vocab_budget.need(e.manifest) for e in entries
                   if e.slot is not None)

    def _free_slot(self, entries: Iterable[AdapterEntry], need: int = 0) -> int | None:
        """An empty slot, or the LRU slot of an idle unpinned adapter (evicted), once ``need``
        bytes of vocabulary modules fit the budget (idle adapters with such parts evicted, LRU
        first). None, evicting nothing, when the adapters in use or pinned leave no room."""
        entries = list(entries)
        budget = self.slots.vocab_budget
        occupants = {e.slot: e for e in entries if e.slot is not None}
        idle = sorted(((s, e) for s, e in occupants.items() if e.refs == 0 and not e.pinned),
                      key=lambda held: held[1].last_used)
        if need:
            sizes = {s: budget.need(e.manifest) for s, e in occupants.items()}
            used = sum(sizes.values())
            if used - sum(sizes[s] for s, _ in idle) + need > budget.nbytes:
                return None
            for slot, victim in [held for held in idle if sizes[held[0]]]:
                if used + need <= budget.nbytes:
                    break
                self._evict_idle(slot, victim, "vocabulary bytes")
                used -= sizes[slot]
                del occupants[slot]
                idle.remove((slot, victim))
        for slot in range(self.slots.num_slots):
            if slot not in occupants and slot not in self._held:
                return slot
        if not idle:
            return None
        slot, victim = idle[0]
        self._evict_idle(slot, victim, "a slot")
        return slot

    def _evict_idle(self, slot: int, victim: AdapterEntry, why: str) -> None:
        log.debug("evicting %s from slot %s for %s", victim.name, slot, why)
        self.metrics.evictions.labels("device").inc()
        self.evict(victim)


WINDOW = 64  # steps remembered for the fit


class AdmissionCostModel:
    def __init__(self, max_hold_s: float = 0.05) -> None:
        self.max_hold_s = max_hold_s
        self._steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (tokens, seconds)
        self._fetch_bytes_per_s: float | None = None
        self._copy_bytes_per_s: float | None = None
        self._holding_since: float | None = None

    # -- observations -------------------------------------------------------------------------
    def observe_step(self, tokens: int, seconds: float) -> None:
        self._steps.append((tokens, seconds))

    def observe_fetch(self, nbytes: int, seconds: float) -> None:
        self._fetch_bytes_per_s = _ewma(self._fetch_bytes_per_s, nbytes / max(seconds, 1e-6))

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        self._copy_bytes_per_s = _ewma(self._copy_bytes_per_s, nbytes / max(seconds, 1e-6))

    # -- estimates ----------------------------------------------------------------------------
    def step_cost(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before enough varied steps were seen."""
        if len(self._steps) < 8:
            return None
        tokens = np.array([t for t, _ in self._steps], dtype=np.float64)
        seconds = np.array([s for _, s in self._steps], dtype=np.float64)
        if np.ptp(tokens) == 0:
            return None
        per_token, fixed = np.polyfit(tokens, seconds, 1)
        return max(float(fixed), 0.0), max(float(per_token), 0.0)

    def eta(self, nbytes: int, started: float, fetching: bool, now: float) -> float | None:
        """Expected seconds until a load of ``nbytes`` that began at ``started`` lands."""
        rate = self._fetch_bytes_per_s if fetching else self._copy_bytes_per_s
        if rate is None:
            return None
        copy = nbytes / self._copy_bytes_per_s if (fetching and self._copy_bytes_per_s) else 0.0
        return max(nbytes / rate + copy - (now - started), 0.0)

    # -- the decision -------------------------------------------------------------------------
    def should_hold(self, etas: list[float | None], now: float | None = None) -> bool:
        """Hold new prefills this step? ``etas``: the loads the next waiting requests need."""
        now = time.monotonic() if now is None else now
        cost = self.step_cost()
        known = [e for e in etas if e is not None]
        if cost is None or not known or min(known) >= cost[0]:
            self._holding_since = None
            return False
        if self._holding_since is None:
            self._holding_since = now
        return now - self._holding_since <= self.max_hold_s  # past it: admit what is ready

    def released(self) -> None:
        """The held requests were admitted: the next hold starts afresh."""
        self._holding_since = None


def _ewma(previous: float | None, value: float, weight: float = 0.3) -> float:
    return value if previous is None else (1 - weight) * previous + weight * value
