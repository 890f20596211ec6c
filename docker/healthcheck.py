"""Container health check for lorastream's services: ``python healthcheck.py TARGET``.

TARGET is either ``HOST:PORT`` of a gRPC service (the adapter store, a GPU worker) or an
``http://`` / ``https://`` URL (the gateway's ``/health``).

- gRPC: asks the server's standard health service (``grpc.health.v1.Health/Check``); healthy when
  it answers SERVING.
- HTTP: sends ``GET URL`` with urllib; healthy when the answer is ``200``.

Exits 0 when healthy, 1 otherwise (not serving, another HTTP status, unreachable, timed out), with
one line on stderr saying why. Docker and docker-compose run it as the service's ``healthcheck``;
it needs only the standard library, grpcio and grpcio-health-checking, which the image installs.

    python /opt/lorastream/healthcheck.py 127.0.0.1:50051
    python /opt/lorastream/healthcheck.py 127.0.0.1:50051 \
        --service lorastream.adapter_store.v1.AdapterStoreService --timeout 2
    python /opt/lorastream/healthcheck.py http://127.0.0.1:8000/health
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

HTTP_SCHEMES = ("http://", "https://")


def check_grpc(target: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """(healthy, reason) for ``service`` ("" = the whole server) at ``target`` (HOST:PORT)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            return False, f"{target}: {err.code().name}: {err.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    label = service or "server"
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{target} {label}: {status}"


def check_http(url: str, timeout: float = 3.0) -> tuple[bool, str]:
    """(healthy, reason) for ``GET url``: healthy on status 200 only."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:  # noqa: S310 (fixed URL)
            status = reply.status
    except urllib.error.HTTPError as err:
        return False, f"{url}: HTTP {err.code} {err.reason}"
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        return False, f"{url}: unreachable: {reason}"
    return status == 200, f"{url}: HTTP {status}"


def check(target: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """(healthy, reason) for a gRPC ``HOST:PORT`` or an HTTP(S) URL."""
    if target.startswith(HTTP_SCHEMES):
        return check_http(target, timeout)
    return check_grpc(target, service, timeout)


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
    args = parser.parse_args(argv)
    healthy, reason = check(args.target, args.service, args.timeout)
    print(reason, file=sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
