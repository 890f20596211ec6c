"""The gateway's picture of its workers: health, resident adapters, load.

**Health comes from the connection, not from a probe's latency.** Each worker has one open gRPC
health ``Watch`` stream: the worker pushes SERVING / NOT_SERVING (draining) as it changes, and a
killed or unreachable worker breaks the stream at once, so it is marked down within about a
second; a worker too busy to answer a probe quickly stays healthy (a false "unhealthy" turned
overload into 503s). The stream is reopened with a short backoff (0.2 s growing to 1 s) while the
worker is down. A hung worker whose connection stays up is not detected this way; its requests
end at the request deadline (504).

Every ``poll_interval_s`` each healthy worker gets a ``ListAdapters`` and a ``GetStats``; a poll
that fails or is slow keeps the last picture and changes no health. Between polls the pool adds
what it did itself: requests in flight per worker, and "recently routed here" hints (an adapter
just sent to a worker is treated as loading there until a poll shows where it really is, or the
hint expires).

With a resolver (``lorastream.gateway.discovery``) the set of workers follows DNS: every
``resolve_interval_s`` the configured names are resolved again; new addresses join, vanished ones
retire (they take no new requests and are closed once their requests in flight have finished).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from lorastream.core.adapter_fit import BaseShape
from lorastream.core.generation import AdapterStatus, WorkerStats
from lorastream.core.tls import ClientTLS
from lorastream.gateway.async_worker_client import AsyncWorkerClient, Probe
from lorastream.gateway.discovery import TargetResolver
from lorastream.gateway.metrics import GatewayMetrics
from lorastream.gateway.routing import TIER_OF_RESIDENCY, Tier, WorkerView

log = logging.getLogger(__name__)

WATCH_BACKOFF_S = (0.2, 1.0)  # first and longest wait before reopening a broken health stream


@dataclass
class WorkerState:
    """One worker as last seen."""

    client: AsyncWorkerClient
    healthy: bool = False
    base_model: str | None = None
    base_shape: BaseShape | None = None  # what an adapter must match to fit its base model
    adapters: list[AdapterStatus] = field(default_factory=list)
    stats: WorkerStats | None = None
    polled_load: int = 0  # waiting + running at the last poll
    inflight: int = 0  # requests this gateway has open on the worker now
    hints: dict[str, float] = field(default_factory=dict)  # adapter -> monotonic routing time
    last_poll: float = 0.0  # monotonic time of the last successful poll
    watch: asyncio.Task[None] | None = None  # the health Watch stream's task
    health_known: asyncio.Event | None = None  # set once the stream gave its first answer

    @property
    def target(self) -> str:
        return self.client.target

    @property
    def load(self) -> int:
        """Queue depth as routing sees it: the poll's, or more if this gateway sent more since."""
        return max(self.polled_load, self.inflight)

    def view(self, now: float, hint_ttl_s: float) -> WorkerView:
        residency = {a.name: TIER_OF_RESIDENCY.get(a.residency, Tier.ABSENT) for a in self.adapters}
        for name, routed_at in list(self.hints.items()):
            if now - routed_at > hint_ttl_s:
                del self.hints[name]
            elif residency.get(name, Tier.ABSENT) < Tier.HOST:
                residency[name] = Tier.HOST
        return WorkerView(self.target, self.healthy, self.load, residency)


class WorkerPool:
    """The workers: ``targets`` as given, or (with ``resolver``) what it resolves them to, from
    the first :meth:`refresh_targets` on."""

    def __init__(
        self,
        targets: list[str],
        metrics: GatewayMetrics,
        *,
        rpc_timeout_s: float = 10.0,
        health_timeout_s: float = 1.0,
        hint_ttl_s: float = 3.0,
        resolver: TargetResolver | None = None,
        resolve_interval_s: float = 5.0,
        tls: ClientTLS | None = None,
        token: str | None = None,
    ) -> None:
        self.workers: dict[str, WorkerState] = {}
        self._token = token  # the workers' operate token (load, unload)
        self._tls = tls  # None: plaintext channels
        self._retiring: dict[str, WorkerState] = {}
        self._metrics = metrics
        self._rpc_timeout_s = rpc_timeout_s
        self._health_timeout_s = health_timeout_s
        self._hint_ttl_s = hint_ttl_s
        self._resolver = resolver
        self._resolve_interval_s = resolve_interval_s
        self._resolved_at = float("-inf")
        if resolver is None:
            self.sync(targets)

    # -- what the router and the API read ---------------------------------------------------
    def views(self) -> list[WorkerView]:
        now = time.monotonic()
        return [w.view(now, self._hint_ttl_s) for w in self.workers.values()]

    def get(self, target: str) -> WorkerState:
        return self.workers.get(target) or self._retiring[target]

    @property
    def healthy_count(self) -> int:
        return sum(w.healthy for w in self.workers.values())

    @property
    def base_model(self) -> str | None:
        """The base model's served name (from the healthy workers, else the last ones seen)."""
        ordered = sorted(self.workers.values(), key=lambda w: not w.healthy)
        return next((w.base_model for w in ordered if w.base_model), None)

    def bases(self) -> dict[str, BaseShape]:
        """Served base model name -> what an adapter must match to fit it, from the healthy
        workers (else the last ones seen), for those that said."""
        workers = list(self.workers.values())
        seen = [w for w in workers if w.healthy] or workers
        return {w.base_model: w.base_shape for w in seen
                if w.base_model and w.base_shape is not None and w.base_shape.known}

    # -- what the dispatcher reports -------------------------------------------------------
    def acquire(self, target: str, adapter: str | None) -> None:
        """A request (for ``adapter``, None for the base model) was routed to ``target``."""
        worker = self.workers[target]
        worker.inflight += 1
        if adapter is not None:
            worker.hints[adapter] = time.monotonic()
        self._metrics.worker_queue.labels(target).set(worker.load)

    def release(self, target: str) -> None:
        worker = self.get(target)
        worker.inflight = max(0, worker.inflight - 1)
        if target in self.workers:
            self._metrics.worker_queue.labels(target).set(worker.load)

    async def confirm_down(self, target: str) -> bool:
        """Health-check ``target`` now (a request to it just failed); mark it unhealthy and
        return True when it is unreachable or not serving. A slow answer is not "down"."""
        worker = self.get(target)
        probe = await worker.client.probe(self._health_timeout_s)
        if probe in (Probe.SERVING, Probe.SLOW):
            return False
        self._set_health(worker, False)
        return True

    # -- membership -------------------------------------------------------------------------
    def sync(self, targets: list[str]) -> None:
        """Make ``targets`` the workers: add new ones, retire the others."""
        for target in targets:
            if target in self.workers:
                continue
            worker = self._retiring.pop(target, None)
            if worker is None:
                worker = WorkerState(AsyncWorkerClient(
                    target, self._rpc_timeout_s, self._tls, self._token,
                    server_name=self._resolver.name_of(target) if self._resolver else None,
                ))
                self._metrics.worker_healthy.labels(target).set(0)
            log.info("worker %s joined", target)
            self.workers[target] = worker
        for target in [t for t in self.workers if t not in targets]:
            log.info("worker %s left; retiring it once its requests finish", target)
            self._retiring[target] = self.workers.pop(target)
            self._stop_watch(self._retiring[target])
            for gauge in (self._metrics.worker_healthy, self._metrics.worker_queue):
                with contextlib.suppress(KeyError):  # a worker never polled has no sample
                    gauge.remove(target)

    async def refresh_targets(self) -> None:
        """Resolve the configured names again (with a resolver) and sync the workers."""
        if self._resolver is not None:
            self._resolved_at = time.monotonic()
            self.sync(await self._resolver.resolve())

    async def _close_retired(self) -> None:
        for target, worker in list(self._retiring.items()):
            if worker.inflight == 0:
                del self._retiring[target]
                self._stop_watch(worker)
                await worker.client.close()

    # -- health ---------------------------------------------------------------------------
    async def watch_all(self) -> None:
        """Open a health stream to every worker that has none; wait (up to the health timeout)
        for the first answer of the streams opened for the first time."""
        first: list[asyncio.Event] = []
        for worker in self.workers.values():
            if worker.watch is None or worker.watch.done():
                if worker.health_known is None:
                    worker.health_known = asyncio.Event()
                    first.append(worker.health_known)
                worker.watch = asyncio.create_task(
                    self._watch(worker), name=f"health-watch {worker.target}"
                )
        if first:
            waits = [asyncio.create_task(event.wait()) for event in first]
            _, pending = await asyncio.wait(waits, timeout=self._health_timeout_s)
            for task in pending:
                task.cancel()

    async def _watch(self, worker: WorkerState) -> None:
        backoff = WATCH_BACKOFF_S[0]
        while True:
            try:
                async for serving in worker.client.watch_health():
                    backoff = WATCH_BACKOFF_S[0]
                    self._set_health(worker, serving)
                    self._known(worker)
                reason = "the worker ended its health stream"
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                details = getattr(exc, "details", None)  # a grpc.RpcError's text
                reason = (details() if callable(details) else str(exc)) or type(exc).__name__
            if worker.healthy:
                log.warning("worker %s: health stream broke (%s)", worker.target, reason)
            self._set_health(worker, False)
            self._known(worker)
            await asyncio.sleep(backoff)
            backoff = min(WATCH_BACKOFF_S[1], backoff * 2)

    @staticmethod
    def _known(worker: WorkerState) -> None:
        if worker.health_known is not None:
            worker.health_known.set()

    @staticmethod
    def _stop_watch(worker: WorkerState) -> None:
        if worker.watch is not None:
            worker.watch.cancel()
            worker.watch = None

    # -- polling ----------------------------------------------------------------------------
    async def poll_once(self) -> None:
        await self.watch_all()
        await asyncio.gather(*(self._poll(w) for w in self.workers.values()))
        bases = {w.base_model for w in self.workers.values() if w.healthy and w.base_model}
        if len(bases) > 1:
            log.warning("workers serve different base models %s; route by adapter only", bases)

    async def run(self, interval_s: float) -> None:
        """Poll forever (until cancelled)."""
        while True:
            started = time.monotonic()
            try:
                if started - self._resolved_at >= self._resolve_interval_s:
                    await self.refresh_targets()
                await self.poll_once()
                await self._close_retired()
            except Exception:
                log.exception("worker poll failed")
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))

    async def close(self) -> None:
        workers = [*self.workers.values(), *self._retiring.values()]
        for worker in workers:
            self._stop_watch(worker)
        await asyncio.gather(*(w.client.close() for w in workers))

    async def _poll(self, worker: WorkerState) -> None:
        """Adapters and load of a healthy worker; health itself is the health stream's."""
        if not worker.healthy:
            return
        client = worker.client
        try:
            (adapters, base_model, base_shape), stats = await asyncio.gather(
                client.list_adapters(), client.stats()
            )
        except Exception as exc:
            log.info("worker %s: poll failed (%s); keeping its last picture", worker.target, exc)
            return
        worker.adapters, worker.base_model, worker.stats = adapters, base_model, stats
        worker.base_shape = base_shape
        worker.polled_load = stats.waiting_requests + stats.running_requests
        worker.last_poll = time.monotonic()
        self._metrics.worker_queue.labels(worker.target).set(worker.load)

    def _set_health(self, worker: WorkerState, healthy: bool) -> None:
        if worker.healthy != healthy:
            if healthy:
                log.info("worker %s is healthy", worker.target)
            else:
                log.warning("worker %s is unhealthy; routing around it", worker.target)
        worker.healthy = healthy
        self._metrics.worker_healthy.labels(worker.target).set(1 if healthy else 0)
