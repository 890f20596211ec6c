"""Free loopback ports for servers a test starts as separate processes (which cannot bind port 0
and tell us): bound together, so the ports are distinct, then released for the servers."""

from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
