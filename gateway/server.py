"""Run the gateway under uvicorn until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import ssl
from typing import Any

import uvicorn

from lorastream.core.tls import ServerTLS
from lorastream.gateway.app import create_app
from lorastream.gateway.config import GatewaySettings

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5


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
    """Serve HTTP(S) on ``settings.host:port``; open streams get a short grace period on stop."""
    tls = https_options(settings)
    app = create_app(settings)
    log.info("gateway on %s://%s:%d%s, workers %s", "https" if tls else "http", settings.host,
             settings.port, " (mutual TLS)" if "ssl_ca_certs" in tls else "",
             ", ".join(settings.workers))
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # keep the CLI's logging setup
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **tls,
    )
