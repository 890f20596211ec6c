"""Build and run the GPU worker's gRPC server."""

from __future__ import annotations

import gc
import logging
from concurrent import futures

import grpc

from lorastream.core.grpc_service import create_grpc_server, serve_until_signalled
from lorastream.core.grpc_status import ErrorMappingInterceptor
from lorastream.worker.device.device import use_intra_op_threads
from lorastream.worker.engine.engine import Engine
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.servicer import SERVICE, GpuWorkerServicer

log = logging.getLogger(__name__)


def create_server(
    settings: WorkerSettings, engine: Engine | None = None, start_engine: bool = True
) -> tuple[grpc.Server, int, Engine]:
    """Create the server (not started) around an engine, started on a thread of its own unless
    ``start_engine`` is False (the caller runs the loop); returns the server, its port, the
    engine."""
    engine = engine or build_engine(settings)
    server, port = create_grpc_server(
        GpuWorkerServicer(engine), SERVICE, host=settings.host, port=settings.port,
        executor=futures.ThreadPoolExecutor(
            max_workers=settings.max_workers,
            thread_name_prefix="worker",
            initializer=use_intra_op_threads,  # request threads leave the cores to the engine
            initargs=(1,),
        ),
        interceptors=[ErrorMappingInterceptor()],
    )
    if start_engine and not engine.started:  # after the bind: a port in use starts nothing
        engine.start()
    return server, port, engine


def freeze_startup_heap() -> int:
    """Move every object alive now (the model, tokenizer, modules, the server) out of the
    garbage collector's sight; returns how many.

    They live as long as the process, yet a full collection walks all of them: ~200 ms on the
    default model, a gap in every running stream each time Python runs one while serving (once
    in 70-95 s of decoding, traced). After the freeze it walks only what came later."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve(settings: WorkerSettings) -> None:
    """Run the worker until SIGINT or SIGTERM; in-flight streams get a grace period.

    The engine loop runs on the main thread, which loaded the model, so that on the CPU its
    OpenMP pool is the process's only multi-threaded one (``device.use_intra_op_threads``)."""
    server, port, engine = create_server(settings, start_engine=False)
    log.debug("%d startup objects frozen out of garbage collection", freeze_startup_heap())
    server.start()
    log.info(
        "gpu worker serving %s on %s:%d (store %s)",
        settings.base_model_name, settings.host, port, settings.store or "none",
    )
    if settings.metrics_port is not None:
        metrics_port = engine.adapters.metrics.serve(settings.metrics_port, settings.host)
        log.info("Prometheus metrics on http://%s:%d/metrics", settings.host, metrics_port)
    try:
        serve_until_signalled(server, "gpu worker", run=engine.run, stop=engine.stop)
    finally:
        engine.stop()
