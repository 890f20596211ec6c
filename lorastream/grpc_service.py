"""Register a servicer from its protobuf service descriptor.

Equivalent to the generated ``add_<Service>Servicer_to_server``, with one difference: a handler may
yield pre-encoded response bytes (see ``codec.encode_chunk_response``) as well as messages.
"""

from __future__ import annotations

import logging
import signal
import threading

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

from lorastream.codec import serialize_response

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


def serve_until_signalled(server: grpc.Server, what: str, grace: float = 5.0) -> None:
    """Block until SIGINT or SIGTERM (call from the main thread), then stop ``server`` gracefully:
    new calls are refused and calls in flight get ``grace`` seconds to finish."""
    stopping = threading.Event()

    def handle(signum: int, frame: object) -> None:
        log.info("%s: %s received, stopping", what, signal.Signals(signum).name)
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)
    stopping.wait()
    server.stop(grace).wait()
