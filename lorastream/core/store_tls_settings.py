"""The settings a service uses to dial the adapter store over TLS, declared once for the worker
and the gateway (their ``--store-tls-*`` flags and ``LORASTREAM_<SERVICE>_STORE_TLS_*``
variables come from these fields)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings

from lorastream.core.tls import ClientTLS


class StoreTLSSettings(BaseSettings):
    """Mixed into a service's settings class, which sets the variables' prefix."""

    store_tls_ca: Path | None = Field(
        None,
        description="Connect to the store over TLS, trusting this CA (PEM).",
    )
    store_tls_client_cert: Path | None = Field(
        None,
        description="Mutual TLS: the certificate (PEM) this process presents to the store; "
        "needs --store-tls-client-key.",
    )
    store_tls_client_key: Path | None = Field(
        None, description="Private key (PEM) of --store-tls-client-cert."
    )

    def store_client_tls(self) -> ClientTLS | None:
        """The files read and checked (InvalidArgument naming the flag); None: plaintext."""
        return ClientTLS.from_files(
            self.store_tls_ca, self.store_tls_client_cert, self.store_tls_client_key,
            prefix="--store-",
        )
