"""The soak benchmark's worker processes (``soak.py``): started, stopped and restarted by index,
each pinned to its share of the CPUs, their serving intervals and their RSS sampled each second."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import Protocol

import psutil

from lorastream.bench.harness import free_port, resident_bytes, start_serving, stop
from lorastream.bench.soak_client import Interval


class WorkerConfig(Protocol):
    """What the workers are started with (the soak's ``SoakConfig`` has these fields)."""

    @property
    def model(self) -> str: ...
    @property
    def workers(self) -> int: ...
    @property
    def slots(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def host_cache_bytes(self) -> int: ...
    @property
    def kv_cache_bytes(self) -> int: ...
    @property
    def worker_drain_s(self) -> float: ...
    @property
    def pin_workers(self) -> bool: ...


class Workers:
    """The worker processes by index, each one's serving intervals, and their RSS each second."""

    def __init__(self, config: WorkerConfig, store: str) -> None:
        self.config = config
        self.store = store
        self.ports = [free_port() for _ in range(config.workers)]
        self.processes: list[psutil.Process | None] = [None] * config.workers  # RSS read here
        self._popen: dict[int, subprocess.Popen[bytes]] = {}
        self.lifetimes: list[list[Interval]] = [[] for _ in range(config.workers)]
        # per worker: (seconds since start, RSS MB with the fetch child's private memory,
        # the worker's anonymous RSS MB: its heap, without the host arena it shares)
        self.rss: list[list[tuple[float, float, float]]] = [[] for _ in range(config.workers)]
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    def cpus(self, i: int) -> set[int] | None:
        """Worker ``i``'s CPUs with ``pin_workers``: the CPUs of this process dealt out in turn
        (two workers on a 2-core box get one core each, as on two machines; sharing both, their
        compute threads wait on each other's). None: all of them."""
        available = sorted(os.sched_getaffinity(0))
        if not self.config.pin_workers or len(available) < 2:
            return None
        share = max(1, len(available) // self.config.workers)
        start = i * share % len(available)
        return set(available[start:start + share])

    @property
    def targets(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    def start(self, i: int) -> None:
        c = self.config
        args = ["worker", "serve", "--model", c.model, "--port", str(self.ports[i]),
                "--store", self.store, "--max-loras", str(c.slots), "--max-lora-rank",
                str(c.rank), "--host-cache-bytes", str(c.host_cache_bytes),
                "--kv-cache-bytes", str(c.kv_cache_bytes),
                "--drain-seconds", str(c.worker_drain_s), "--metrics-port", "0"]
        process = start_serving(args, self.ports[i], cpus=self.cpus(i))
        self.processes[i] = psutil.Process(process.pid)
        self._popen[i] = process
        self.lifetimes[i].append((time.perf_counter(), float("inf")))

    def stop(self, i: int, how: str) -> None:
        """Stop worker ``i``: ``kill`` (SIGKILL) or ``term`` (SIGTERM, waits for its drain)."""
        process = self._popen[i]
        if how == "kill":
            process.kill()
            gone = time.perf_counter()
            process.wait()
        else:
            process.terminate()
            process.wait(self.config.worker_drain_s + 30)
            gone = time.perf_counter()  # serving until its drain ended (health went off first)
        begin, _ = self.lifetimes[i][-1]
        self.lifetimes[i][-1] = (begin, gone)
        self.processes[i] = None

    def restart(self, i: int, how: str) -> dict[str, float | str]:
        began = time.perf_counter()
        self.stop(i, how)
        stopped = time.perf_counter()
        self.start(i)
        return {"worker": i, "how": how, "at_s": round(began - self.t0, 1),
                "stop_s": round(stopped - began, 2),
                "serving_again_after_s": round(time.perf_counter() - began, 1)}

    def start_sampling(self) -> None:
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            now = round(time.perf_counter() - self.t0, 1)
            for i, process in enumerate(self.processes):
                if process is None:
                    continue
                try:
                    self.rss[i].append((now, round(resident_bytes(process) / 1e6, 1),
                                        anonymous_mb(process.pid)))
                except (psutil.Error, OSError):  # killed between the check and the read
                    continue

    def resident_mb(self, i: int) -> float | None:
        process = self.processes[i]
        return round(resident_bytes(process) / 1e6, 1) if process is not None else None

    def close(self) -> None:
        self._stop.set()
        for process in self._popen.values():
            if process.poll() is None:
                stop(process)


def anonymous_mb(pid: int) -> float:
    """``RssAnon`` of process ``pid`` in MB (from /proc; psutil has no cheap split)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return round(int(line.split()[1]) * 1024 / 1e6, 1)
    return 0.0
