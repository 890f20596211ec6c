"""CPU priority of the adapter loaders: the store fetch (in its process or on worker threads)
and, on a CPU worker, the load stream's copies. No torch here: the fetch process uses it too.

A priority is written ``idle`` (SCHED_IDLE: the thread runs only on CPU time that nothing else
wants) or ``nice:N`` (N added to the thread's nice value; ``nice:0`` leaves it alone).

Why ``idle`` is the default (``--loader-priority``): on a CPU worker a decode step runs its
parallel ops on two OpenMP threads that wait for each other at the end of every op, so any CPU
time taken from either stalls the whole step. A nice value only makes that less likely; a busy
process at SCHED_IDLE costs the streams far less than one at nice 10 (measured:
docs/notes/loading.md, "Loaders at idle CPU priority"). A SCHED_IDLE thread is preempted the moment
a decode thread wakes. Its cost: when every core is busy, it waits; with OpenMP spinning without end
(``OMP_WAIT_POLICY=active``) it can starve, and ``nice:N`` is the choice there.

On Linux both settings are per thread: a thread lowers its own priority, and the threads it
starts afterwards inherit it (the fetch process sets it before gRPC starts any).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Literal

log = logging.getLogger(__name__)

IDLE = "idle"


def loader_priority(mode: Literal["idle", "nice"], nice: int) -> str:
    """The priority of ``--loader-priority MODE`` with ``--loader-nice NICE``."""
    return IDLE if mode == "idle" else f"nice:{nice}"


def lower_priority(priority: str) -> None:
    """Lower the calling thread's CPU priority to ``priority``; threads it starts later inherit
    it. Where that is not possible (not Linux, not permitted) the thread keeps its priority."""
    if priority != IDLE and not priority.startswith("nice:"):
        raise ValueError(f"unknown loader priority {priority!r}: use idle or nice:N")
    tid = threading.get_native_id()
    try:
        if priority == IDLE:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        elif (nice := int(priority.removeprefix("nice:"))) > 0:
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (AttributeError, OSError):
        log.debug("could not set priority %s on %s", priority, threading.current_thread().name)


def starvation_warning(priority: str, openmp_waits_actively: bool) -> str | None:
    """Why idle loaders may starve, or None: OpenMP told to spin without end
    (:func:`lorastream.worker.device.cpu.native_env.waits_actively`) keeps every core busy
    while the engine decodes, so SCHED_IDLE loaders get no time."""
    if priority == IDLE and openmp_waits_actively:
        return ("OMP_WAIT_POLICY=active keeps the cores busy while decoding, so adapter loads at "
                "--loader-priority idle may wait until decoding pauses; use --loader-priority "
                "nice, or unset OMP_WAIT_POLICY")
    return None
