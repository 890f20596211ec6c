"""`lorastream up`'s readiness wait (``wait_serving``) finds a part soon after it starts listening.

gRPC's default reconnect backoff grows (1 s, 1.6 s, 2.6 s, ... up to 120 s): a wait that polls a
plain channel found a worker that started listening at 3 s only at the next reconnect, ~5 s. The
wait's channel caps the backoff and its health Watch waits for the connection.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lorastream.core.errors import SourceUnavailable
from lorastream.stack.launcher import wait_serving


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def alive() -> Iterator[subprocess.Popen[bytes]]:
    """A process standing in for the part being started (alive throughout)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def _serve_later(
    port: int, delay_s: float, status: int
) -> tuple[threading.Timer, list[grpc.Server]]:
    """A health server (``status``) on ``port`` after ``delay_s``; the list gets it once up."""
    servers: list[grpc.Server] = []

    def start() -> None:
        server = grpc.server(futures.ThreadPoolExecutor(2))
        servicer = health.HealthServicer()
        servicer.set("", status)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        servers.append(server)

    timer = threading.Timer(delay_s, start)
    timer.start()
    return timer, servers


@pytest.mark.parametrize("delay_s", [0.0, 3.0], ids=["already-serving", "starts-after-3s"])
def test_wait_serving_returns_soon_after_the_server_starts(
    alive: subprocess.Popen[bytes], delay_s: float
) -> None:
    port = _free_port()
    timer, servers = _serve_later(port, delay_s, health_pb2.HealthCheckResponse.SERVING)
    started = time.monotonic()
    try:
        wait_serving(f"127.0.0.1:{port}", alive, 20)
        waited = time.monotonic() - started
    finally:
        timer.join()
        for server in servers:
            server.stop(None)
    assert delay_s <= waited < delay_s + 0.8, waited


def test_wait_serving_fails_fast_when_the_process_dies_and_times_out_on_not_serving(
    alive: subprocess.Popen[bytes],
) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    with pytest.raises(SourceUnavailable, match="exited with status 0"):
        wait_serving(f"127.0.0.1:{_free_port()}", dead, 20)
    port = _free_port()
    timer, servers = _serve_later(port, 0.0, health_pb2.HealthCheckResponse.NOT_SERVING)
    timer.join()
    started = time.monotonic()
    try:
        with pytest.raises(SourceUnavailable, match="did not become healthy within 2 s"):
            wait_serving(f"127.0.0.1:{port}", alive, 2)
    finally:
        for server in servers:
            server.stop(None)
    assert time.monotonic() - started < 3.5
