"""A shared cap on the store's streaming egress, in bytes per second.

Every ``StreamAdapterTensors`` stream asks the limiter before sending a chunk; the limiter hands
out send times in order, so all streams together stay under the rate, like traffic through one
network link. Operators use it to keep adapter streams from saturating a NIC that also carries
other traffic; benchmarks use it to put a realistic link between the store and a worker on
loopback.

A link may bank up to ``burst_bytes`` of idle time (a token bucket of that depth, like ``tc
tbf``'s burst): a real link keeps draining the socket send buffer while the sending process is
off the CPU, so a sender that was late for a few chunks catches up by that much. With no burst
(the default) every chunk waits for its own slot on the link, and time the sender lost is lost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class EgressLimiter:
    """Paces chunks so that the bytes sent by all streams stay within ``bytes_per_s``.

    ``acquire(n)`` reserves the link for ``n`` bytes and sleeps until the reservation starts:
    reservations never overlap, and the link banks at most ``burst_bytes`` of idle time (a
    stream that starts after a quiet period may send that much at once, but no faster than the
    rate thereafter).
    """

    def __init__(
        self,
        bytes_per_s: float,
        burst_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"egress rate must be positive, got {bytes_per_s}")
        if burst_bytes < 0:
            raise ValueError(f"egress burst must not be negative, got {burst_bytes}")
        self.bytes_per_s = bytes_per_s
        self._banked_s = burst_bytes / bytes_per_s  # idle link time a late sender may use
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._link_free_at = 0.0  # when the last reservation ends

    def acquire(self, nbytes: int) -> float:
        """Wait for this chunk's turn on the link; returns the seconds waited."""
        with self._lock:
            now = self._clock()
            start = max(now - self._banked_s, self._link_free_at)
            self._link_free_at = start + nbytes / self.bytes_per_s
        wait = start - now
        if wait > 0:
            self._sleep(wait)
        return max(wait, 0.0)
