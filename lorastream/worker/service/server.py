"""Build and run the GPU worker's gRPC server."""

from __future__ import annotations

import gc
import logging
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from lorastream.core.auth import refuse_open_bind
from lorastream.core.grpc_service import create_grpc_server, serve_until_signalled
from lorastream.core.grpc_status import BearerTokenInterceptor, ErrorMappingInterceptor
from lorastream.core.tls import ServerTLS
from lorastream.worker.device.cpu.threads import use_one_intra_op_thread
from lorastream.worker.engine.engine import Engine
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.drain import WorkerDrain
from lorastream.worker.service.servicer import REQUIRED_SCOPES, SERVICE, GpuWorkerServicer

log = logging.getLogger(__name__)

# What LoadAdapter, UnloadAdapter and ResetPrefixCache answer on a worker with no operate token
# and no --insecure-no-auth: with ``local_path`` a load takes any directory on this host, so an
# open worker would let any local user swap the weights served under a name (docs/security.md).
NO_TOKEN_REFUSAL = (
    "this worker has no operate token, so it changes no adapters for anyone: start it with "
    "LORASTREAM_WORKER_TOKEN (or --token-file) and call with that token, or pass "
    "--insecure-no-auth to let anyone who reaches its port load and unload adapters"
)

# After the drain and the engine's stop: how long the requests it ended get to send their error.
STOP_GRACE_S = 2.0


@dataclass
class WorkerServer:
    """A worker's gRPC server (not started), its bound port, its engine and its drain."""

    server: grpc.Server
    port: int
    engine: Engine
    drain: WorkerDrain


def create_server(
    settings: WorkerSettings, engine: Engine | None = None, start_engine: bool = True
) -> tuple[grpc.Server, int, Engine]:
    """Create the server (not started) around an engine, started on a thread of its own unless
    ``start_engine`` is False (the caller runs the loop); returns the server, its port, the
    engine.

    Raises InvalidArgument, before building the engine, when it would serve other hosts with no
    token (see ``refuse_open_bind``) or the token file cannot be read."""
    built = build_server(settings, engine, start_engine)
    return built.server, built.port, built.engine


def build_server(
    settings: WorkerSettings, engine: Engine | None = None, start_engine: bool = True
) -> WorkerServer:
    """:func:`create_server`, with the drain that stops it gracefully (``WorkerDrain``)."""
    tokens = settings.access_tokens()
    refuse_open_bind(
        settings.host, tokens.enabled, settings.insecure_no_auth, "GPU worker",
        "LORASTREAM_WORKER_TOKEN (or --token-file)",
    )
    closed = None if tokens.enabled or settings.insecure_no_auth else NO_TOKEN_REFUSAL
    if closed is not None:
        log.warning("gpu worker has no operate token: LoadAdapter, UnloadAdapter and "
                    "ResetPrefixCache are refused (set LORASTREAM_WORKER_TOKEN or --token-file "
                    "to allow them with it, or pass --insecure-no-auth to open them to anyone); "
                    "generation is served")
    else:
        log.info("gpu worker auth (load, unload): %s", tokens.describe())
    tls = ServerTLS.from_files(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    engine = engine or build_engine(settings)
    health_servicer = health.HealthServicer()
    drain = WorkerDrain(engine, health_servicer, settings.drain_seconds)
    server, port = create_grpc_server(
        GpuWorkerServicer(engine, drain), SERVICE, host=settings.host, port=settings.port,
        executor=futures.ThreadPoolExecutor(
            max_workers=settings.max_workers,
            thread_name_prefix="worker",
            initializer=use_one_intra_op_thread,  # request threads leave the cores to the engine
        ),
        interceptors=[
            BearerTokenInterceptor(tokens, REQUIRED_SCOPES, refuse_without_token=closed),
            ErrorMappingInterceptor(),
        ],
        tls=tls,
        health_servicer=health_servicer,
    )
    if start_engine and not engine.started:  # after the bind: a port in use starts nothing
        engine.start()
    return WorkerServer(server, port, engine, drain)


def freeze_startup_heap() -> int:
    """Move every object alive now (the model, tokenizer, modules, the server) out of the
    garbage collector's sight; returns how many.

    They live as long as the process, yet a full collection walks all of them: a gap in every
    running stream each time Python runs one while serving (measured: docs/notes/engine.md,
    "Objects frozen out of the collector"). After the freeze it walks only what came later."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve(settings: WorkerSettings) -> None:
    """Run the worker until SIGINT or SIGTERM, then drain (``WorkerDrain``: health NOT_SERVING,
    new requests refused, up to ``settings.drain_seconds`` for those in flight), end what is
    left with UNAVAILABLE and return.

    The engine loop runs on the main thread, which loaded the model, so that on the CPU its
    OpenMP pool is the process's only multi-threaded one (``device/cpu/threads.py``)."""
    built = build_server(settings, start_engine=False)
    server, port, engine = built.server, built.port, built.engine
    log.debug("%d startup objects frozen out of garbage collection", freeze_startup_heap())
    if settings.metrics_port is not None:  # first: a port in use stops it before it serves
        metrics_port = engine.adapters.metrics.serve(settings.metrics_port, settings.host)
        log.info("Prometheus metrics on http://%s:%d/metrics", settings.host, metrics_port)
    server.start()
    log.info(
        "gpu worker serving %s on %s:%d over %s (store %s)",
        settings.base_model_name, settings.host, port,
        "plaintext" if settings.tls_cert is None else "TLS", settings.store or "none",
    )
    try:
        serve_until_signalled(
            server, "gpu worker", grace=STOP_GRACE_S, run=engine.run, stop=engine.stop,
            drain=built.drain.run, hurry=built.drain.hurry,
        )
    finally:
        engine.stop()
