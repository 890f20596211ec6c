"""Register a servicer from its protobuf service descriptor.

Equivalent to the generated ``add_<Service>Servicer_to_server``, with one difference: a handler may
yield pre-encoded response bytes (see ``codec.encode_chunk_response``) as well as messages.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

from lorastream.core.codec import serialize_response

log = logging.getLogger(__name__)


def add_servicer(server: grpc.Server, servicer: object, service: ServiceDescriptor) -> None:
    """Add every method of ``service`` implemented by ``servicer`` to ``server``."""
    handlers = {}
    for method in service.methods:
        if method.client_streaming:
            raise NotImplementedError(f"{method.full_name}: client streaming is not used here")
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=GetMessageClass(method.input_type).FromString,
            response_serializer=serialize_response,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )


def serve_until_signalled(
    server: grpc.Server,
    what: str,
    grace: float = 5.0,
    *,
    run: Callable[[], None] | None = None,
    stop: Callable[[], None] | None = None,
) -> None:
    """Block until SIGINT or SIGTERM (call from the main thread), then stop ``server`` gracefully:
    new calls are refused and calls in flight get ``grace`` seconds to finish.

    With ``run``, the main thread runs ``run()`` instead of waiting (the GPU worker's engine
    loop). On the signal a helper thread stops the server gracefully, so that streams in flight
    keep being served, and then calls ``stop()``, which must make ``run`` return.
    """
    stopping = threading.Event()
    shutdown: list[threading.Thread] = []

    def shut_down() -> None:
        server.stop(grace).wait()
        if stop is not None:
            stop()

    def handle(signum: int, frame: object) -> None:
        log.info("%s: %s received, stopping", what, signal.Signals(signum).name)
        if run is not None and not stopping.is_set():
            thread = threading.Thread(target=shut_down, name="shutdown", daemon=True)
            shutdown.append(thread)
            thread.start()
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)
    if run is None:
        stopping.wait()
        server.stop(grace).wait()
        return
    try:
        run()
    finally:
        if shutdown:
            shutdown[0].join()
        else:  # run() ended on its own
            server.stop(grace).wait()
