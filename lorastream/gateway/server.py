"""Run the gateway under uvicorn until SIGINT or SIGTERM, draining first (``gateway.drain``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import ssl
import sys
from types import FrameType
from typing import Any

import uvicorn

from lorastream.core.tls import ServerTLS
from lorastream.gateway.app import create_app
from lorastream.gateway.config import GatewaySettings
from lorastream.gateway.drain import Drain

log = logging.getLogger(__name__)

# After the drain: how long uvicorn waits for the last responses (the cut streams' error events,
# a /health in flight) before it cancels them.
GRACEFUL_SHUTDOWN_S = 5
STARTUP_FAILURE = 3  # uvicorn's exit status when the server could not start


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGINT/SIGTERM drains (``Drain.run``) before it
    stops, and then exits with status 0; a second one ends the drain at once (the open streams
    are cut with their error event and ``[DONE]``, exit 0); a third is uvicorn's own."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_seconds: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_seconds = drain_seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task[None] | None = None
        self._stopping_now = False  # a second signal came during the drain

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._stopping_now:
            super().handle_exit(sig, frame)  # not serving yet, or a third signal
            return
        if self._drain.draining:
            log.warning("gateway: %s received again, ending the drain now",
                        signal.Signals(sig).name)
            self._stopping_now = True
            self._loop.call_soon_threadsafe(self._drain.stop_now)
            return
        log.info("gateway: %s received, draining (up to %.0f s; again to stop at once)",
                 signal.Signals(sig).name, self._drain_seconds)
        self._drain.draining = True  # readiness off now, before the loop runs the drain
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._draining = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain.run(self._drain_seconds)
        finally:
            self.should_exit = True


def https_options(settings: GatewaySettings) -> dict[str, Any]:
    """uvicorn's TLS arguments for ``--tls-cert``/``--tls-key``/``--tls-client-ca`` (the files
    checked first, InvalidArgument naming the flag); empty for plain HTTP."""
    if ServerTLS.from_files(settings.tls_cert, settings.tls_key, settings.tls_client_ca) is None:
        return {}
    options: dict[str, Any] = {"ssl_certfile": str(settings.tls_cert),
                               "ssl_keyfile": str(settings.tls_key)}
    if settings.tls_client_ca is not None:  # mutual TLS: no certificate, no handshake
        options |= {"ssl_ca_certs": str(settings.tls_client_ca),
                    "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return options


def serve(settings: GatewaySettings) -> None:
    """Serve HTTP(S) on ``settings.host:port`` until SIGINT/SIGTERM; then drain for up to
    ``settings.drain_seconds`` (``lorastream.gateway.drain``) and return."""
    tls = https_options(settings)
    app = create_app(settings)
    log.info("gateway on %s://%s:%d%s, workers %s", "https" if tls else "http", settings.host,
             settings.port, " (mutual TLS)" if "ssl_ca_certs" in tls else "",
             ", ".join(settings.workers))
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # keep the CLI's logging setup
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **tls,
    )
    server = DrainingServer(config, app.state.drain, settings.drain_seconds)
    with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C, raised again once stopped
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
