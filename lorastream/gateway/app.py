"""Build the gateway's FastAPI app: wiring, lifespan (polling), /health, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lorastream import __version__
from lorastream.core.auth import refuse_open_bind
from lorastream.core.errors import InvalidArgument
from lorastream.core.store_client import StoreClient
from lorastream.core.tls import ClientTLS
from lorastream.gateway import routes_adapters, routes_openai, routes_prefix_cache, routes_vllm
from lorastream.gateway.body_limit import BodyLimit
from lorastream.gateway.config import GatewaySettings
from lorastream.gateway.discovery import TargetResolver
from lorastream.gateway.dispatch import Dispatcher
from lorastream.gateway.drain import Drain, RefuseWhileDraining
from lorastream.gateway.http_errors import install_handlers
from lorastream.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from lorastream.gateway.routing import Router
from lorastream.gateway.state import GatewayState, gateway_state
from lorastream.gateway.worker_pool import WorkerPool

log = logging.getLogger(__name__)


class RequestCounter:
    """Counts /v1/* responses by route template and status code."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(endpoint, str(status)).inc()


def build_state(
    settings: GatewaySettings, metrics: GatewayMetrics, worker_tls: ClientTLS | None = None,
    store_tls: ClientTLS | None = None, drain: Drain | None = None,
) -> GatewayState:
    """Every component, wired (call inside the event loop: it opens grpc.aio channels); the
    channels to the workers and to the store are over TLS when given one."""
    resolver = TargetResolver(settings.workers) if settings.resolve_interval_s > 0 else None
    pool = WorkerPool(
        settings.workers, metrics, rpc_timeout_s=settings.rpc_timeout_s,
        health_timeout_s=settings.health_timeout_s, hint_ttl_s=settings.routing_hint_ttl_s,
        resolver=resolver, resolve_interval_s=settings.resolve_interval_s, tls=worker_tls,
        token=settings.effective_worker_token,
    )
    router = Router(settings.spill_threshold, settings.max_requests_per_worker,
                    settings.spill_fraction, prefix_table=settings.prefix_affinity_entries,
                    policy=settings.routing)
    metrics.watch_residency(pool.views)
    return GatewayState(
        settings=settings,
        metrics=metrics,
        pool=pool,
        router=router,
        dispatcher=Dispatcher(pool, router, metrics, settings.request_timeout_s),
        store=StoreClient(settings.store, settings.effective_store_token,
                          timeout=settings.rpc_timeout_s, tls=store_tls),
        started_at=int(time.time()),
        drain=drain or Drain(),
    )


def create_app(settings: GatewaySettings) -> FastAPI:
    """The gateway app; ``app.state.drain`` is its graceful stop (``lorastream.gateway.server``
    runs it on SIGINT/SIGTERM)."""
    if not settings.workers:
        raise InvalidArgument("the gateway needs at least one worker: pass --worker HOST:PORT")
    refuse_open_bind(
        settings.host, bool(settings.token), settings.insecure_no_auth, "gateway",
        "LORASTREAM_GATEWAY_TOKEN (or --token-file)",
    )
    metrics = GatewayMetrics(adapter_labels=settings.metrics_adapter_labels)
    drain = Drain()
    # read and checked now: a wrong certificate path stops the gateway before it serves
    worker_tls = ClientTLS.from_files(
        settings.worker_tls_ca, settings.worker_tls_client_cert, settings.worker_tls_client_key,
        prefix="--worker-",
    )
    store_tls = settings.store_client_tls()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = build_state(settings, metrics, worker_tls, store_tls, drain)
        app.state.gateway = state
        if not settings.token:
            log.warning("no operate token: the operator endpoints (/v1/adapters) are open to "
                        "anyone who reaches the gateway")
        log.info("gateway auth: operator endpoints %s, OpenAI endpoints %s",
                 "need the operate token" if settings.token else "open",
                 f"need one of {len(settings.api_keys)} API keys" if settings.api_keys
                 else "open")
        await state.pool.refresh_targets()
        await state.pool.poll_once()  # /health is right from the first request
        poller = asyncio.create_task(state.pool.run(settings.poll_interval_s))
        log.info("gateway: %d/%d workers healthy, store %s", state.pool.healthy_count,
                 len(settings.workers), settings.store)
        try:
            yield
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            await state.pool.close()
            state.store.close()

    app = FastAPI(
        title="lorastream gateway",
        version=__version__,
        summary="OpenAI-compatible API over lorastream's GPU workers; one adapter per model name.",
        lifespan=lifespan,
        strict_content_type=False,  # `curl -d '{...}'` without -H 'Content-Type: ...' works too
    )
    app.state.drain = drain
    install_handlers(app)
    app.include_router(routes_openai.router)
    app.include_router(routes_adapters.router)
    app.include_router(routes_prefix_cache.router)
    app.include_router(routes_vllm.operate_router)
    app.include_router(routes_vllm.read_router)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(RefuseWhileDraining, drain=drain)
    app.add_middleware(RequestCounter, metrics=metrics)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """200 when at least one worker is healthy and the gateway is not draining, else 503."""
        pool = gateway_state(request).pool
        workers: dict[str, Any] = {
            w.target: {"healthy": w.healthy, "queue_depth": w.load, "base_model": w.base_model}
            for w in pool.workers.values()
        }
        ok = pool.healthy_count > 0 and not drain.draining
        status = "draining" if drain.draining else "ok" if ok else "unavailable"
        return JSONResponse({"status": status, "workers": workers},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    return app
