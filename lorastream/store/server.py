"""Build and run the adapter store's gRPC server."""

from __future__ import annotations

import logging
from concurrent import futures

import grpc

from lorastream.core.auth import refuse_open_bind
from lorastream.core.grpc_service import create_grpc_server, serve_until_signalled
from lorastream.core.grpc_status import BearerTokenInterceptor, ErrorMappingInterceptor
from lorastream.core.tls import ServerTLS
from lorastream.store.config import StoreSettings
from lorastream.store.egress import EgressLimiter
from lorastream.store.servicer import REQUIRED_SCOPES, SERVICE, AdapterStoreServicer
from lorastream.store.sources import SourceRegistry
from lorastream.store.sources.hub import HubSource
from lorastream.store.sources.local import LocalSource
from lorastream.store.sources.s3 import S3Source
from lorastream.store.store import AdapterStore

log = logging.getLogger(__name__)

def build_store(settings: StoreSettings) -> AdapterStore:
    """The store core with every source wired from the settings."""
    sources = SourceRegistry(
        [
            LocalSource(settings.allowed_local_roots),
            S3Source(
                endpoint_url=settings.s3_endpoint_url,
                max_concurrency=settings.s3_max_concurrency,
                max_attempts=settings.s3_max_attempts,
            ),
            HubSource(endpoint=settings.hf_endpoint, token=settings.hf_token),
        ]
    )
    return AdapterStore(
        settings.cache_dir,
        settings.cache_bytes,
        sources,
        max_header_bytes=settings.max_header_bytes,
        max_upload_bytes=settings.max_upload_bytes,
        tensor_digest=settings.tensor_digest,
    )


def create_server(
    settings: StoreSettings, store: AdapterStore | None = None
) -> tuple[grpc.Server, int, AdapterStore]:
    """Create (not start) the store server; returns it with its bound port and its core.

    Raises InvalidArgument when it would serve other hosts with no token (see
    ``refuse_open_bind``) or a token file cannot be read."""
    tokens = settings.access_tokens()
    refuse_open_bind(
        settings.host, tokens.enabled, settings.insecure_no_auth, "adapter store",
        "LORASTREAM_STORE_TOKEN and LORASTREAM_STORE_READ_TOKEN (or --token-file, "
        "--read-token-file)",
    )
    log.info("adapter store auth: %s", tokens.describe())
    tls = ServerTLS.from_files(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    store = store or build_store(settings)
    egress = (
        EgressLimiter(settings.egress_limit_mbps * 1e6, settings.egress_burst_bytes)
        if settings.egress_limit_mbps else None
    )
    servicer = AdapterStoreServicer(
        store, settings.chunk_bytes, settings.stream_chunk_delay_s, egress
    )
    server, port = create_grpc_server(
        servicer, SERVICE, host=settings.host, port=settings.port,
        executor=futures.ThreadPoolExecutor(
            max_workers=settings.max_workers, thread_name_prefix="store"
        ),
        interceptors=[
            BearerTokenInterceptor(tokens, REQUIRED_SCOPES),
            ErrorMappingInterceptor(),
        ],
        tls=tls,
    )
    return server, port, store


def _tls_note(settings: StoreSettings) -> str:
    if settings.tls_cert is None:
        return " (plaintext)"
    return " (mutual TLS)" if settings.tls_client_ca is not None else " (TLS)"


def serve(settings: StoreSettings) -> None:
    """Run the store until SIGINT or SIGTERM, then stop it gracefully."""
    server, port, store = create_server(settings)
    if settings.metrics_port is not None:  # first: a port in use stops it before it serves
        metrics_port = store.metrics.serve(settings.metrics_port, settings.host)
        log.info("Prometheus metrics on http://%s:%d/metrics", settings.host, metrics_port)
    server.start()
    log.info(
        "adapter store serving on %s:%d%s (cache %s, budget %.1f GiB, %d adapters)",
        settings.host,
        port,
        _tls_note(settings),
        settings.cache_dir,
        settings.cache_bytes / (1 << 30),
        store.count(),
    )
    serve_until_signalled(server, "adapter store")
