"""Container health check for lorastream's gRPC services: ``python healthcheck.py HOST:PORT``.

Asks the server's standard health service (``grpc.health.v1.Health/Check``) and exits 0 when it
answers SERVING, 1 otherwise (not serving, unreachable, timed out), with one line on stderr saying
why. Docker and docker-compose run it as the service's ``healthcheck``; it needs only grpcio and
grpcio-health-checking, which the image installs.

    python /opt/lorastream/healthcheck.py 127.0.0.1:50051
    python /opt/lorastream/healthcheck.py 127.0.0.1:50051 \
        --service lorastream.adapter_store.v1.AdapterStoreService --timeout 2
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """(healthy, reason) for ``service`` ("" = the whole server) at ``target`` (HOST:PORT)."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            return False, f"{target}: {err.code().name}: {err.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    label = service or "server"
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{target} {label}: {status}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("target", help="HOST:PORT of the gRPC server, e.g. 127.0.0.1:50051")
    parser.add_argument(
        "--service", default="", help="service name to check (default: the whole server)"
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for a reply")
    args = parser.parse_args(argv)
    healthy, reason = check(args.target, args.service, args.timeout)
    print(reason, file=sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
