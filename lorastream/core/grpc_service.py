"""The gRPC server side both services share: build, bind, serve until signalled.

``create_grpc_server`` is the one bootstrap of the adapter store and the GPU worker: the servicer,
gRPC health (SERVING) and reflection (v1 and v1alpha, ``lorastream.core.reflection``), message
limits, TLS when given (``lorastream.core.tls``), and a bind that refuses a port in use.
``add_servicer`` is equivalent to the generated ``add_<Service>Servicer_to_server``, with one
difference: a handler may yield pre-encoded response bytes (see ``codec.encode_chunk_response``)
as well as messages.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lorastream.core.codec import serialize_response
from lorastream.core.errors import InvalidArgument
from lorastream.core.reflection import enable_reflection
from lorastream.core.tls import ServerTLS

log = logging.getLogger(__name__)

SERVER_OPTIONS = [
    # Messages carry up to 4 MiB of tensor bytes plus framing.
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.max_receive_message_length", 16 << 20),
    # grpc sets SO_REUSEPORT by default on Linux: a second server on a port in use would bind
    # without error and the kernel would split connections between the two processes.
    ("grpc.so_reuseport", 0),
]


def create_grpc_server(
    servicer: object,
    service: ServiceDescriptor,
    *,
    host: str,
    port: int,
    executor: futures.ThreadPoolExecutor,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    tls: ServerTLS | None = None,
    health_servicer: health.HealthServicer | None = None,
) -> tuple[grpc.Server, int]:
    """A server (not started) with ``servicer``, health (SERVING, overall and for ``service``)
    and reflection (v1 and v1alpha), bound to ``host:port`` (0: any free port) over TLS with
    ``tls`` (mutual when it has a client CA), else plaintext; returns it with its bound port.
    ``health_servicer``: the caller's, to turn NOT_SERVING later (a drain), else a new one.

    Raises InvalidArgument naming the address when it cannot be bound (a port in use)."""
    server = grpc.server(executor, interceptors=list(interceptors), options=SERVER_OPTIONS)
    add_servicer(server, servicer, service)
    if health_servicer is None:
        health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", service.full_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    enable_reflection(server, (service.full_name, health.SERVICE_NAME))
    address = f"{host}:{port}"
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, tls.grpc_credentials())
    except RuntimeError:  # grpc >= 1.5x raises where older versions returned 0
        bound = 0
    if bound == 0:
        raise InvalidArgument(
            f"cannot listen on {address}: address in use (is another lorastream server or "
            "`lorastream up` running?) or not an address of this host; stop the other server "
            "or pick another --port/--host"
        )
    return server, bound


def add_servicer(server: grpc.Server, servicer: object, service: ServiceDescriptor) -> None:
    """Add every method of ``service`` implemented by ``servicer`` to ``server``."""
    handlers = {}
    for method in service.methods:
        if method.client_streaming and method.server_streaming:
            raise NotImplementedError(f"{method.full_name}: bidirectional streaming is not used")
        if method.client_streaming:
            make = grpc.stream_unary_rpc_method_handler
        elif method.server_streaming:
            make = grpc.unary_stream_rpc_method_handler
        else:
            make = grpc.unary_unary_rpc_method_handler
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
    drain: Callable[[], None] | None = None,
    hurry: Callable[[], None] | None = None,
) -> None:
    """Block until SIGINT or SIGTERM (call from the main thread), then stop ``server`` gracefully:
    new calls are refused and calls in flight get ``grace`` seconds to finish.

    With ``run``, the main thread runs ``run()`` instead of waiting (the GPU worker's engine
    loop). On the signal a helper thread stops the server gracefully, so that streams in flight
    keep being served, and then calls ``stop()``, which must make ``run`` return.

    With ``drain`` (and ``run``), the helper thread first calls ``drain()``, which turns
    readiness off and returns once the calls in flight have finished or its deadline has passed;
    then ``stop()`` ends what is left (their streams end with an error) and the server stops,
    giving those errors ``grace`` seconds to reach their clients. A second signal calls
    ``hurry()``, which must make ``drain()`` return at once.
    """
    stopping = threading.Event()
    shutdown: list[threading.Thread] = []

    def shut_down() -> None:
        if drain is not None:
            drain()
            if stop is not None:
                stop()
            server.stop(grace).wait()
            return
        server.stop(grace).wait()
        if stop is not None:
            stop()

    def handle(signum: int, frame: object) -> None:
        log.info("%s: %s received, stopping", what, signal.Signals(signum).name)
        if stopping.is_set() and hurry is not None:
            hurry()
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
