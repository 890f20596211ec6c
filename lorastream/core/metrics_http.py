"""Serve a Prometheus registry on ``http://HOST:PORT/metrics`` (the store's and the worker's)."""

from __future__ import annotations

import errno

from prometheus_client import CollectorRegistry, start_http_server

from lorastream.core.errors import InvalidArgument


def serve_registry(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> int:
    """Serve ``registry`` on a daemon thread; returns the bound port (``port`` 0 picks one).

    Raises InvalidArgument naming ``--metrics-port`` when the port is taken (another worker or
    store on this machine listens there)."""
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            raise
        raise InvalidArgument(
            f"the metrics port {host}:{port} is in use (another lorastream process on this "
            "machine?); pass --metrics-port with a free port (0: any free one)"
        ) from None
    return int(server.server_address[1])
