"""Run the gateway under uvicorn until SIGINT or SIGTERM."""

from __future__ import annotations

import logging

import uvicorn

from lorastream.gateway.app import create_app
from lorastream.gateway.config import GatewaySettings

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5


def serve(settings: GatewaySettings) -> None:
    """Serve HTTP on ``settings.host:port``; open streams get a short grace period on stop."""
    app = create_app(settings)
    log.info("gateway on http://%s:%d, workers %s", settings.host, settings.port,
             ", ".join(settings.workers))
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # keep the CLI's logging setup
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
