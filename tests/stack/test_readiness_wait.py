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

WAIT_S = 20  # how long a test waits for the wait: a bound on a hang only


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


ATTEMPTS = 8  # refused connections before the server starts: ~2 s capped, ~40 s at gRPC's default


class _AnsweringHealth(health.HealthServicer):
    """Health that records in ``seen`` each time it answers a Watch."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self._seen = seen

    def Watch(self, request, context, send_response_callback=None):  # type: ignore[no-untyped-def]  # grpc's untyped signature
        self._seen.append("answered")
        return super().Watch(request, context, send_response_callback)


def _serve(port: int, seen: list[str]) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = _AnsweringHealth(seen)
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


@pytest.mark.parametrize("refused", [0, ATTEMPTS], ids=["already-serving", "starts-later"])
def test_wait_serving_keeps_trying_and_returns_once_the_server_answers(
    alive: subprocess.Popen[bytes], refused: int
) -> None:
    """Attempts and order, not seconds: until the server starts, a listener accepts and closes
    each connection (``refused`` of them); the wait must make them all (a backoff growing to
    gRPC's default would take ~40 s for 8), then return after the server answered it."""
    port = _free_port()
    seen: list[str] = []
    listener = socket.create_server(("127.0.0.1", port))
    listener.settimeout(WAIT_S)
    waiter = threading.Thread(
        target=lambda: (wait_serving(f"127.0.0.1:{port}", alive, WAIT_S), seen.append("returned")))
    server = None
    try:
        waiter.start()
        for _ in range(refused):
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                pytest.fail(f"the wait stopped trying: {seen.count('refused')} attempts")
            connection.close()
            seen.append("refused")
        listener.close()
        server = _serve(port, seen)
        waiter.join(timeout=WAIT_S)
    finally:
        listener.close()
        if server is not None:
            server.stop(None)
    assert seen[:refused] == ["refused"] * refused
    assert seen[refused:] == ["answered", "returned"], seen


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
