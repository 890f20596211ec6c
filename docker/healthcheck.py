"""Container health check for lorastream's services: ``python healthcheck.py TARGET``.

TARGET is either ``HOST:PORT`` of a gRPC service (the adapter store, a GPU worker) or an
``http://`` / ``https://`` URL (the gateway's ``/health``).

- gRPC: asks the server's standard health service (``grpc.health.v1.Health/Check``); healthy when
  it answers SERVING.
- HTTP: sends ``GET URL`` with urllib; healthy when the answer is ``200``.

Over TLS (servers started with ``--tls-cert``), ``--tls-ca`` is the CA to trust and, for mutual
TLS, ``--tls-client-cert``/``--tls-client-key`` the certificate to present; the server's
certificate must then be valid for the host of TARGET (``localhost:50051``, not ``127.0.0.1``,
when the certificate names ``localhost``).

Exits 0 when healthy, 1 otherwise (not serving, another HTTP status, unreachable, timed out), with
one line on stderr saying why. Docker and docker-compose run it as the service's ``healthcheck``;
it needs only the standard library, grpcio and grpcio-health-checking, which the image installs.

    python /opt/lorastream/healthcheck.py 127.0.0.1:50051
    python /opt/lorastream/healthcheck.py 127.0.0.1:50051 \
        --service lorastream.adapter_store.v1.AdapterStoreService --timeout 2
    python /opt/lorastream/healthcheck.py http://127.0.0.1:8000/health
    python /opt/lorastream/healthcheck.py localhost:50051 --tls-ca /run/secrets/ca.pem \
        --tls-client-cert /run/secrets/client.pem --tls-client-key /run/secrets/client-key.pem
"""

from __future__ import annotations

import argparse
import ssl
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HTTP_SCHEMES = ("http://", "https://")


@dataclass(frozen=True)
class TLS:
    """The CA to trust and, for mutual TLS, the certificate and key to present (PEM files)."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None


def check_grpc(target: str, service: str = "", timeout: float = 3.0,
               tls: TLS | None = None) -> tuple[bool, str]:
    """(healthy, reason) for ``service`` ("" = the whole server) at ``target`` (HOST:PORT)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if tls is None:
        channel = grpc.insecure_channel(target)
    else:
        credentials = grpc.ssl_channel_credentials(
            tls.ca.read_bytes(),
            tls.key.read_bytes() if tls.key else None,
            tls.cert.read_bytes() if tls.cert else None,
        )
        channel = grpc.secure_channel(target, credentials)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            return False, f"{target}: {err.code().name}: {err.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    label = service or "server"
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{target} {label}: {status}"


def check_http(url: str, timeout: float = 3.0, tls: TLS | None = None) -> tuple[bool, str]:
    """(healthy, reason) for ``GET url``: healthy on status 200 only."""
    context = None
    if tls is not None:
        context = ssl.create_default_context(cafile=str(tls.ca))
        if tls.cert is not None:
            context.load_cert_chain(tls.cert, tls.key)
    try:
        # the URL is the health check's own argument, not user input
        with urllib.request.urlopen(url, timeout=timeout, context=context) as reply:
            status = reply.status
    except urllib.error.HTTPError as err:
        return False, f"{url}: HTTP {err.code} {err.reason}"
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        return False, f"{url}: unreachable: {reason}"
    return status == 200, f"{url}: HTTP {status}"


def check(target: str, service: str = "", timeout: float = 3.0,
          tls: TLS | None = None) -> tuple[bool, str]:
    """(healthy, reason) for a gRPC ``HOST:PORT`` or an HTTP(S) URL."""
    if target.startswith(HTTP_SCHEMES):
        return check_http(target, timeout, tls)
    return check_grpc(target, service, timeout, tls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "target",
        help="HOST:PORT of a gRPC server (e.g. 127.0.0.1:50051) or an HTTP URL "
        "(e.g. http://127.0.0.1:8000/health)",
    )
    parser.add_argument(
        "--service", default="", help="gRPC service name to check (default: the whole server)"
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for a reply")
    parser.add_argument("--tls-ca", type=Path, help="connect over TLS, trusting this CA (PEM)")
    parser.add_argument("--tls-client-cert", type=Path, help="mutual TLS: certificate (PEM)")
    parser.add_argument("--tls-client-key", type=Path, help="mutual TLS: its private key (PEM)")
    args = parser.parse_args(argv)
    if (args.tls_client_cert or args.tls_client_key) and not args.tls_ca:
        parser.error("--tls-client-cert/--tls-client-key need --tls-ca")
    tls = TLS(args.tls_ca, args.tls_client_cert, args.tls_client_key) if args.tls_ca else None
    try:
        healthy, reason = check(args.target, args.service, args.timeout, tls)
    except OSError as err:  # a certificate file missing or unreadable
        healthy, reason = False, f"{args.target}: {err}"
    print(reason, file=sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
