"""CPU time of an adapter load's loaders, read from the kernel's per-process accounting.

A load from the store costs CPU in two processes besides the worker's own: the store (reading,
checksumming and sending the chunks) and the worker's fetch process (receiving, landing and
verifying them). On the benchmarks' 2-core box both share the cores the worker decodes on, at
idle priority, so their CPU time per load says how much of the box a load needs to land at link
speed, and therefore what it must take from the decode (``bench serve``'s cold probe).
"""

from __future__ import annotations

import psutil


def cpu_seconds(process: psutil.Process) -> float:
    """User + system CPU seconds ``process`` has used so far (0 once it is gone)."""
    try:
        times = process.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


class LoaderCpu:
    """The store's CPU time plus that of the worker's child processes (its fetch process)."""

    def __init__(self, store_pid: int, worker_pid: int) -> None:
        self._store = psutil.Process(store_pid)
        self._worker = psutil.Process(worker_pid)

    def seconds(self) -> float:
        children = self._worker.children(recursive=True)
        return cpu_seconds(self._store) + sum(cpu_seconds(child) for child in children)
