"""Where a cold request's wait goes: one :class:`LoadTimeline` per load of an adapter that a
request found off the device, from the request's arrival to its admission.

The phases, in order (they add up to the whole wait)::

    resolve    request arrived -> its adapter's name resolved (a cold name may ask the store)
    queue      resolved -> its fetch began on a fetch thread (fetches queue one at a time)
    stream     the store stream, less landing and checksums: socket reads, message parsing,
               waiting for the link (CPU: the fetch process's, all its threads)
    checksum   each tensor's digest, checked once its last byte landed
    landing    chunks written at their offsets in host memory
    handoff    fetch ended -> the copy into a slot was submitted
    slot_copy  submitted -> copied (on the CPU: turns between the steps; CPU: the copy thread's)
    admission  copied -> the scheduler found the adapter ready for its request

Each phase is recorded with its wall time and, where something computes in it, the CPU time it
took (``time.thread_time`` / ``time.process_time``): a phase whose CPU is far below its wall time
waited for a core (or for the link), one close to it was busy. Timestamps are single assignments
from the threads that see each event (request, fetch and copy threads, the engine loop); nothing
here takes a lock or touches the device, so it costs the step loop nothing but a few clock reads
per load. The adapter manager closes a timeline when its request is admitted: a debug log line
and the ``lorastream_worker_cold_load_phase_seconds`` histogram (``phase``, ``clock``) per phase.
An adapter found in host memory has no fetch phases.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from lorastream.worker.loading.landing import FetchTimes


@dataclass
class LoadTimeline:
    requested: float  # perf_counter: the first request that found the adapter off the device
    resolved: float | None = None  # its name resolved (None: not timed, as good as requested)
    fetch_began: float | None = None
    fetch_ended: float | None = None
    fetch: FetchTimes | None = None  # from the fetch (process), once it landed
    copy_submitted: float | None = None
    copy_began: float | None = None  # the copy's first operation ran
    copy_ended: float | None = None
    copy_cpu_s: float = 0.0  # the copy thread's CPU from its first operation to its last
    admitted: float | None = None

    @classmethod
    def now(cls) -> LoadTimeline:
        return cls(time.perf_counter())

    @property
    def copied(self) -> bool:
        return self.copy_ended is not None

    def phases(self) -> dict[str, tuple[float, float | None]]:
        """``{phase: (wall seconds, CPU seconds or None)}`` of the phases this load went through
        (see the module's docstring), plus ``total``; call it once admitted."""
        out: dict[str, tuple[float, float | None]] = {}
        resolved = self.requested if self.resolved is None else self.resolved
        out["resolve"] = (resolved - self.requested, None)
        fetched_at = resolved
        if self.fetch_began is not None and self.fetch_ended is not None and self.fetch:
            f = self.fetch
            fetch_wall = self.fetch_ended - self.fetch_began
            out["queue"] = (max(self.fetch_began - resolved, 0.0), None)
            out["stream"] = (max(fetch_wall - f.landing_s - f.checksum_s, 0.0),
                             max(f.cpu_s - f.landing_cpu_s - f.checksum_cpu_s, 0.0))
            out["checksum"] = (f.checksum_s, f.checksum_cpu_s)
            out["landing"] = (f.landing_s, f.landing_cpu_s)
            fetched_at = self.fetch_ended
        if self.copy_submitted is not None and self.copy_ended is not None:
            out["handoff"] = (max(self.copy_submitted - fetched_at, 0.0), None)
            out["slot_copy"] = (self.copy_ended - self.copy_submitted, self.copy_cpu_s)
            if self.admitted is not None:
                out["admission"] = (self.admitted - self.copy_ended, None)
        if self.admitted is not None:
            out["total"] = (self.admitted - self.requested, None)
        return out

    def describe(self) -> str:
        """One line for the log: each phase's wall time, with its CPU time where measured."""
        parts = []
        for phase, (wall, cpu) in self.phases().items():
            cpu_text = "" if cpu is None else f" (cpu {cpu * 1000:.0f})"
            parts.append(f"{phase} {wall * 1000:.0f}{cpu_text}")
        return ", ".join(parts) + " ms"
