"""Pod-shaped lorastream model servers on loopback, as ``deploy/k8s/inference-pool/
model-server.yaml`` runs them: per pod a worker process (``lorastream worker serve`` with its
metrics port, where the picker scrapes the vLLM-named gauges) and a one-worker gateway as its
OpenAI front (here in this process, on a thread: the sidecar). ``lorastream bench pool`` routes
over them; :meth:`Pods.restart` stops every worker and starts it again, so each run begins cold
(nothing in a slot or in host memory) on fresh fronts.

Each worker runs on its share of this process's CPUs (dealt out in turn, as the soak benchmark
does: three workers on two cores give cores 0, 1, 0), so one pod's decoding does not slow the
others' threads through shared cores more than a machine's worth.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import httpx

from lorastream.bench.harness import free_port, serve_app, spawn, stop
from lorastream.stack.launcher import wait_serving

if TYPE_CHECKING:
    import uvicorn


@dataclass(frozen=True)
class PodSettings:
    """What every pod's worker is started with (``lorastream worker serve`` flags)."""

    model: str = "default"
    slots: int = 2  # --max-loras: max_lora in vllm:lora_requests_info
    max_lora_rank: int = 8
    max_batch_size: int = 8
    host_cache_bytes: int = 16 << 20  # a few adapters: residency matters past the slots
    kv_cache_bytes: int = 64 << 20
    start_timeout_s: float = 600.0
    picker_running: str = "held"  # --picker-running: what vllm:lora_requests_info lists

    def worker_args(self, port: int, metrics_port: int, store: str) -> list[str]:
        return ["worker", "serve", "--model", self.model, "--served-model-name", "base",
                "--port", str(port), "--metrics-port", str(metrics_port), "--store", store,
                "--max-loras", str(self.slots), "--max-lora-rank", str(self.max_lora_rank),
                "--max-batch-size", str(self.max_batch_size),
                "--host-cache-bytes", str(self.host_cache_bytes),
                "--kv-cache-bytes", str(self.kv_cache_bytes), "--drain-seconds", "0",
                "--picker-running", self.picker_running]


class Front:
    """A gateway app over ``workers`` served by uvicorn on a loopback port, on a thread."""

    def __init__(self, workers: list[str], store: str, token: str, name: str) -> None:
        from lorastream.gateway.app import create_app
        from lorastream.gateway.config import GatewaySettings

        settings = GatewaySettings(workers=workers, store=store, token=token, drain_seconds=0)
        self.server: uvicorn.Server
        self.server, self.thread, self.url = serve_app(create_app(settings), name)
        self._wait_healthy(len(workers))

    def _wait_healthy(self, workers: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            health = httpx.get(f"{self.url}/health", timeout=5)
            if health.status_code == 200 and sum(
                    w["healthy"] for w in health.json()["workers"].values()) == workers:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the gateway at {self.url} did not see {workers} healthy workers")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


class Pods:
    """``count`` pods over the store at ``store``: worker processes by index, their metrics URLs,
    their fronts, and one gateway over all of them (lorastream's own routing)."""

    def __init__(self, count: int, store: str, settings: PodSettings) -> None:
        self.settings = settings
        self.store = store
        self.token = secrets.token_urlsafe(16)  # the fronts' operate token, used as API key
        self.ports = [free_port() for _ in range(count)]
        self.metrics_ports = [free_port() for _ in range(count)]
        self._processes: list[subprocess.Popen[bytes] | None] = [None] * count
        self.fronts: list[Front] = []
        self.gateway: Front | None = None

    @property
    def targets(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    @property
    def metrics_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}/metrics" for port in self.metrics_ports]

    def cpus(self, i: int) -> set[int] | None:
        available = sorted(os.sched_getaffinity(0))
        if len(available) < 2:
            return None
        share = max(1, len(available) // len(self.ports))
        start = i * share % len(available)
        return set(available[start:start + share])

    def start(self) -> float:
        """Every worker started at once, then the fronts and the gateway; seconds until all
        serve."""
        began = time.perf_counter()
        for i, port in enumerate(self.ports):
            args = self.settings.worker_args(port, self.metrics_ports[i], self.store)
            self._processes[i] = spawn(args, cpus=self.cpus(i))
        for target, process in zip(self.targets, self._processes, strict=True):
            assert process is not None
            wait_serving(target, process, self.settings.start_timeout_s)
        self.fronts = [Front([t], self.store, self.token, f"front-{i}")
                       for i, t in enumerate(self.targets)]
        self.gateway = Front(self.targets, self.store, self.token, "gateway")
        return time.perf_counter() - began

    def stop(self) -> None:
        for front in [*self.fronts, *([self.gateway] if self.gateway else [])]:
            front.stop()
        self.fronts, self.gateway = [], None
        for i, process in enumerate(self._processes):
            if process is not None and process.poll() is None:
                stop(process, grace_s=30)
            self._processes[i] = None

    def restart(self, picker_running: str | None = None) -> float:
        """Every pod cold again: workers stopped and started (with ``--picker-running``
        ``picker_running`` when given), new fronts; seconds it took."""
        self.stop()
        if picker_running is not None:
            self.settings = replace(self.settings, picker_running=picker_running)
        return self.start()

    def http(self, timeout_s: float = 600) -> httpx.Client:
        """A client for the fronts and the gateway (their API key set)."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        return httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits,
                            headers={"Authorization": f"Bearer {self.token}"})
